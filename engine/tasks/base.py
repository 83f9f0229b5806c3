"""A task is a list of prompts with reference answers and a reward function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Example:
    prompt: str          # text shown to the model (chat template applied later if configured)
    answer: str          # reference passed to the reward function


# reward(prompt, response, answer) -> float in [0, 1] for built-in tasks
RewardFn = Callable[[str, str, str], float]


@dataclass
class Task:
    name: str
    train: list[Example]
    val: list[Example]
    reward: RewardFn
    # optional exact-correctness check, reported as "accuracy" when present
    correct: Optional[Callable[[str, str, str], bool]] = None
    # characters the built-in tokenizer must cover (built-in tasks only)
    alphabet: str = ""
