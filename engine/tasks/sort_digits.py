"""Built-in task ``sort``: sort four digits ('5281:' -> '1258').

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
from engine.tasks.base import Example, Task

SORT_LENGTH = 4


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

    def sample() -> Example:
        digits = "".join(rng.choice(string.digits) for _ in range(SORT_LENGTH))
        return Example(prompt=f"{digits}:", answer="".join(sorted(digits)))

    val = [sample() for _ in range(cfg.num_val)]
    held_out = {e.prompt for e in val}
    train: list[Example] = []
    while len(train) < cfg.num_train:
        e = sample()
        if e.prompt not in held_out:
            train.append(e)
    return Task("sort", train, val, sort_reward, correct=sort_correct,
                alphabet=string.digits + ":")
