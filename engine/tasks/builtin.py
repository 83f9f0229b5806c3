"""Built-in verifiable tasks a tiny model can learn from scratch on a CPU, with dense
rule-based rewards (partial credit), generated procedurally from a seed."""

from __future__ import annotations

import random
import string

from engine.config.schema import TaskConfig
from engine.data.example import Example
from engine.tasks.base import Task

ECHO_LENGTH = 6


def echo_reward(prompt: str, response: str, answer: str) -> float:
    """Fraction of the first len(answer) characters that match (the letter repeated)."""
    hits = sum(1 for a, b in zip(response, answer) if a == b)
    return hits / len(answer)


def echo_correct(prompt: str, response: str, answer: str) -> bool:
    return response[:len(answer)] == answer


ECHO_LETTERS = "abcdefgh"


def make_echo_task(cfg: TaskConfig, seed: int) -> Task:
    """Prompt 'c:' -> answer 'cccccc' over 8 letters. The policy must read the prompt's letter
    (a random policy scores ~1/13 per character)."""
    rng = random.Random(seed)
    letters = ECHO_LETTERS
    def sample() -> Example:
        c = rng.choice(letters)
        return Example(prompt=f"{c}:", answer=c * ECHO_LENGTH)
    train = [sample() for _ in range(cfg.num_train)]
    val = [sample() for _ in range(cfg.num_val)]
    return Task("echo", train, val, echo_reward, correct=echo_correct,
                alphabet=letters + ":")


def add_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 for the exact sum; otherwise partial credit per correct digit (position-wise)."""
    resp = response.strip()
    if resp == answer:
        return 1.0
    hits = sum(1 for a, b in zip(resp, answer) if a == b)
    return 0.5 * hits / max(len(answer), len(resp), 1)


def add_correct(prompt: str, response: str, answer: str) -> bool:
    return response.strip() == answer


def make_add_task(cfg: TaskConfig, seed: int) -> Task:
    """'23+19=' -> '42'."""
    rng = random.Random(seed)
    def sample() -> Example:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))
    train = [sample() for _ in range(cfg.num_train)]
    val = [sample() for _ in range(cfg.num_val)]
    return Task("add", train, val, add_reward, correct=add_correct,
                alphabet=string.digits + "+=")
