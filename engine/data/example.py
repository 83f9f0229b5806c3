"""One prompt of a task or dataset: what the data loaders produce and the tasks hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    prompt: Any          # text, or a list of {role, content} messages (rendered with the chat template)
    answer: Any          # reference passed to the reward function (usually a string)
    row: dict = field(default_factory=dict, compare=False)   # other columns, passed to the reward by name
    origin: str = field(default="", compare=False)           # "train.parquet row 17", for error messages
