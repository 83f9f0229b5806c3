"""Built-in task ``arith``: procedurally generated arithmetic word problems for a small
instruct model (sized for SmolLM2-135M-Instruct), answered as "Answer: <number>".

Each prompt is a short story problem ("Mia has 7 pens. She buys 5 more pens. How many pens
does Mia have now?") followed by the format instruction. The reference answer is the integer.

Scoring (``arith_reward``), documented in docs/smollm2.md:
  * the *final number* of a response is the integer after the last "Answer:" when there is
    one, else the last integer anywhere in the response;
  * correct (``arith_correct``): the final number equals the reference exactly;
  * reward = 0.9 * correct + 0.1 * formatted, where formatted means the response's last
    non-empty line is exactly "Answer: <integer>". So a correct, well-formatted reply scores
    1.0, a correct number in free text 0.9, a well-formatted wrong answer 0.1, else 0.0.
    The small format credit gives RL a signal on problems the model cannot yet solve.

Splits: problems are drawn from ``random.Random(seed)``; the held-out split (``num_val``) is
drawn first, and training problems never repeat a held-out *computation* (same operation on
the same numbers), in any wording. Same seed, same splits.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Optional

from engine.config.schema import TaskConfig
from engine.errors import ConfigError
from engine.data.example import Example
from engine.tasks.base import Task

FORMAT_INSTRUCTION = 'End your reply with the final answer as "Answer: <number>".'

NAMES = [("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He"), ("Zoe", "She"),
         ("Sam", "He"), ("Lily", "She"), ("Ben", "He"), ("Emma", "She"), ("Max", "He")]
ITEMS = ["apples", "pens", "stickers", "marbles", "books", "cards", "shells", "coins",
         "cookies", "stamps"]

# (operation, template). Placeholders: name, pron, item, a, b, c.
ADD = [
    "{name} has {a} {item}. {pron} buys {b} more {item}. How many {item} does {name} have now?",
    "{name} had {a} {item} and found {b} more. How many {item} does {name} have in total?",
]
SUB = [
    "{name} has {a} {item}. {pron} gives {b} {item} to a friend. How many {item} does {name} have left?",
    "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have left?",
]
MUL = [
    "A box holds {a} {item}. How many {item} are in {b} boxes?",
    "{name} buys {b} bags with {a} {item} in each bag. How many {item} does {name} buy?",
]
ADD_SUB = [
    "{name} has {a} {item}. {pron} buys {b} more and then gives away {c}. How many {item} does {name} have now?",
]

_ANSWER = re.compile(r"Answer:\s*(-?\d+)")
_INTEGER = re.compile(r"-?\d+")
_FORMATTED_LAST_LINE = re.compile(r"Answer:\s*-?\d+\.?")


def _one_step(rng: random.Random, top: int, ops: str) -> tuple[tuple, str, int]:
    op = rng.choice(ops)
    if op == "+":
        a, b = rng.randint(1, top), rng.randint(1, top)
        return ("+", a, b), rng.choice(ADD).format(a=a, b=b, c=0, **_who(rng)), a + b
    if op == "-":
        a = rng.randint(2, top)
        b = rng.randint(1, a - 1)
        return ("-", a, b), rng.choice(SUB).format(a=a, b=b, c=0, **_who(rng)), a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return ("*", a, b), rng.choice(MUL).format(a=a, b=b, c=0, **_who(rng)), a * b


def _two_step(rng: random.Random, top: int) -> tuple[tuple, str, int]:
    a, b = rng.randint(1, top), rng.randint(1, top)
    c = rng.randint(1, a + b - 1)
    return ("+-", a, b, c), rng.choice(ADD_SUB).format(a=a, b=b, c=c, **_who(rng)), a + b - c


def _who(rng: random.Random) -> dict:
    name, pron = rng.choice(NAMES)
    return {"name": name, "pron": pron, "item": rng.choice(ITEMS)}


# difficulty level -> problem generator (rng -> (computation key, story, answer))
LEVELS: dict[int, Callable[[random.Random], tuple[tuple, str, int]]] = {
    1: lambda rng: _one_step(rng, 20, "+-"),
    2: lambda rng: _one_step(rng, 50, "+-*"),
    3: lambda rng: _two_step(rng, 20),
}
DEFAULT_LEVEL = 1


def make_problem(rng: random.Random, level: int = DEFAULT_LEVEL) -> tuple[tuple, Example]:
    key, story, answer = LEVELS[level](rng)
    return key, Example(prompt=f"{story}\n{FORMAT_INSTRUCTION}", answer=str(answer))


def final_number(response: str) -> Optional[int]:
    """The integer after the last "Answer:", else the last integer in the response."""
    tagged = _ANSWER.findall(response)
    if tagged:
        return int(tagged[-1])
    numbers = _INTEGER.findall(response)
    return int(numbers[-1]) if numbers else None


def is_formatted(response: str) -> bool:
    """The last non-empty line is exactly "Answer: <integer>" (a trailing period allowed)."""
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    return bool(lines) and _FORMATTED_LAST_LINE.fullmatch(lines[-1]) is not None


def arith_correct(prompt: str, response: str, answer: str) -> bool:
    return final_number(response) == int(answer)


def arith_reward(prompt: str, response: str, answer: str) -> float:
    return 0.9 * float(arith_correct(prompt, response, answer)) + 0.1 * float(is_formatted(response))


def make_arith_task(cfg: TaskConfig, seed: int, level: int = DEFAULT_LEVEL) -> Task:
    """``num_val`` held-out and ``num_train`` training problems, deterministic from ``seed``."""
    if level not in LEVELS:
        raise ConfigError(f"arith: unknown difficulty level {level}; known: {sorted(LEVELS)}")
    rng = random.Random(f"arith-{level}-{seed}")
    val: list[Example] = []
    val_keys: set[tuple] = set()
    seen: set[str] = set()
    attempts = 0
    while len(val) < cfg.num_val:
        attempts += 1
        key, ex = make_problem(rng, level)
        if key not in val_keys:
            val_keys.add(key)
            seen.add(ex.prompt)
            val.append(ex)
        if attempts > 100 * (cfg.num_val + 1):
            raise ConfigError(f"arith: cannot draw {cfg.num_val} distinct held-out problems; lower task.num_val")
    train: list[Example] = []
    attempts = 0
    while len(train) < cfg.num_train:
        attempts += 1
        key, ex = make_problem(rng, level)
        if key not in val_keys and ex.prompt not in seen:
            seen.add(ex.prompt)
            train.append(ex)
        if attempts > 100 * (cfg.num_train + 1):
            raise ConfigError(
                f"arith: cannot draw {cfg.num_train} distinct training problems; lower task.num_train"
            )
    return Task(name="arith", train=train, val=val, reward=arith_reward, correct=arith_correct)
