"""A task is a list of prompts with reference answers and a reward function."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.data.example import Example


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
    # importable reward/correctness functions (engine.rewards.spec.RewardFnSpec); empty = derived
    # from `reward` / `correct`, which must then be module-level functions
    reward_specs: list = field(default_factory=list)
    # how the data was read (dataset tasks): format, source, fingerprint, dropped rows ...
    data_info: dict = field(default_factory=dict)
    # tools the model may call (multi-turn, engine/agents): plain functions; task.tools overrides
    tools: list = field(default_factory=list)
    # module:Class of the task's own environment (engine/agents/environment.py); task.environment overrides
    environment: str = ""
