"""Built-in task ``sort``: sort ``task.sort_length`` digits (default four: '5281:' -> '1258').

Harder than ``echo`` for a random-init tiny model: every output position depends on the
whole prompt (the k-th smallest digit), and the response must stop after exactly as many
digits as the prompt has. Reward (``sort_reward``): 1.0 for the exact sorted string;
otherwise 0.5 x the share of positions that match, over the longer of response and answer
(so a response that runs on past the answer loses credit). Accuracy: exact match.
"""

from __future__ import annotations

import random
import string

from engine.config.schema import TaskConfig
from engine.errors import ConfigError
from engine.data.example import Example
from engine.tasks.base import Task

SORT_LENGTH = 4   # the default of task.sort_length


def sort_reward(prompt: str, response: str, answer: str) -> float:
    resp = response.strip()
    if resp == answer:
        return 1.0
    hits = sum(1 for a, b in zip(resp, answer) if a == b)
    return 0.5 * hits / max(len(answer), len(resp), 1)


def sort_correct(prompt: str, response: str, answer: str) -> bool:
    return response.strip() == answer


def make_sort_task(cfg: TaskConfig, seed: int) -> Task:
    """Held-out prompts are drawn first; training prompts never repeat a held-out digit string."""
    rng = random.Random(seed)
    length = getattr(cfg, "sort_length", SORT_LENGTH)

    def sample() -> Example:
        digits = "".join(rng.choice(string.digits) for _ in range(length))
        return Example(prompt=f"{digits}:", answer="".join(sorted(digits)))

    val = [sample() for _ in range(cfg.num_val)]
    held_out = {e.prompt for e in val}
    if len(held_out) >= 10 ** length:
        raise ConfigError(f"task.num_val={cfg.num_val} holds out every one of the {10 ** length} prompts of "
                          f"task.sort_length={length}, leaving none to train on; lower task.num_val or raise "
                          f"task.sort_length.", title="invalid config")
    train: list[Example] = []
    while len(train) < cfg.num_train:
        e = sample()
        if e.prompt not in held_out:
            train.append(e)
    return Task("sort", train, val, sort_reward, correct=sort_correct,
                alphabet=string.digits + ":")
