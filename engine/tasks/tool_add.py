"""Built-in task ``tool_add``: a sum of two 6-digit numbers modulo 7, with a calculator the model may call.

Prompt ``'123456+654321%7='`` -> answer ``'4'`` ((123456 + 654321) mod 7). Without a tool a tiny
model would have to add twelve digits and reduce the sum mod 7 in its head, which it does not
learn in a CPU run (its held-out accuracy stays near chance, 1/7). With the calculator the task is
a call and a copy: the model ends a turn with ``]`` (the built-in tokenizer's compact tool-call
format, engine/agents/parsers.py; a bare ``]`` asks for the question's own expression,
engine/agents/calculator_env.py), the tool's result is appended, and the model copies it as its
final turn. The answer is one digit, so the copy is one token: a copy of several digits from the
tool message is beyond what a random-init tiny model discovers by RL (measured: 3-digit sums with
the tool stayed at 0 held-out accuracy in 800 steps; docs/agents.md).

Scoring (task=add's ``add_reward``) looks at the model's *last turn* only (tool output is never
credited by itself): 1.0 for the exact answer, else 0.5 x the fraction of digits right by position
(partial credit, as task=add). The no-tool twin is the same task with ``rollout.max_turns=1``: a call
then ends the trajectory and scores nothing, so the model must answer by itself.
"""

from __future__ import annotations

import random
import re
import string

from engine.config.schema import TaskConfig
from engine.data.example import Example
from engine.tasks.base import Task
from engine.tasks.builtin import add_correct, add_reward  # the same scoring as task=add

MODULUS = 7
_EXPR = re.compile(r"\s*(\d+(?:\s*\+\s*\d+)+)\s*(?:%\s*(\d+))?\s*")


def calculator(expr: str) -> str:
    """Adds whole numbers, optionally modulo a number.

    Args:
        expr: two or more whole numbers joined by '+', optionally followed by '%' and a modulus, like 123+456%7
    """
    m = _EXPR.fullmatch(expr)
    if not m:
        raise ValueError("write two or more whole numbers joined by '+', optionally then '%' and a modulus")
    total = sum(int(x) for x in re.findall(r"\d+", m.group(1)))
    if m.group(2) is None:
        return str(total)
    if int(m.group(2)) == 0:
        raise ValueError("modulo 0")
    return str(total % int(m.group(2)))


def make_tool_add_task(cfg: TaskConfig, seed: int) -> Task:
    rng = random.Random(seed)

    def sample() -> Example:
        a, b = rng.randint(100000, 999999), rng.randint(100000, 999999)
        return Example(prompt=f"{a}+{b}%{MODULUS}=", answer=str((a + b) % MODULUS))

    val = [sample() for _ in range(cfg.num_val)]
    held = {e.prompt for e in val}
    train = []
    while len(train) < cfg.num_train:
        e = sample()
        if e.prompt not in held:
            train.append(e)
    return Task("tool_add", train, val, add_reward, correct=add_correct,
                alphabet=string.digits + "+%=]", tools=[calculator],
                environment="engine.agents.calculator_env:CalculatorEnvironment")
