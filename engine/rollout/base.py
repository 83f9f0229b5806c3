"""The rollout interface: prompts in, sampled sequences with their log-probs out."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.batch import SequenceBatch


class Sampler(ABC):
    """Generates ``n`` responses per prompt.

    Returns a SequenceBatch with rows ordered prompt-major (prompt 0's n samples first),
    ``rollout_log_probs[b, t]`` = log p(input_ids[b, t] | <t) under the sampling
    distribution (after temperature; before top-p truncation) on response positions.
    """

    @abstractmethod
    def generate(self, model: torch.nn.Module | None, prompts: list[list[int]], n: int,
                 generator: torch.Generator, greedy: bool = False) -> SequenceBatch:
        ...

    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Push new policy weights into the rollout engine; returns seconds spent.
        The torch sampler reads the live model, so this is a no-op there."""
        return 0.0
