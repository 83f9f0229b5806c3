"""``task.reward_model.placement=colocated``: the reward model in the process that scores the
rewards (the driver of ``rl train``, the process of ``rl eval``), on the ranks' device: GPU 0
when ``trainer.device`` is cuda (or auto with a GPU), else the CPU. Loaded at its first batch."""

from __future__ import annotations

from typing import Optional

from engine.rewards.call import Sample
from engine.rewards.scorers import ScorerFailed, finite_scores


class ColocatedRewardModel:
    name = "reward_model"

    def __init__(self, rm_cfg, device: str = "auto"):
        self.cfg, self.weight, self.requested = rm_cfg, float(rm_cfg.weight), device
        self.model: Optional[object] = None

    def describe(self) -> str:
        return f"{self.weight:g} x {self.name} {self.cfg.path} (colocated, batches of {self.cfg.batch_size})"

    def load(self):
        if self.model is None:
            from engine.device import resolve_device
            from engine.reward_model.model import RewardModel

            c = self.cfg
            self.model = RewardModel(c.path, device=str(resolve_device(self.requested)), dtype=c.dtype,
                                     batch_size=c.batch_size, max_length=c.max_length, label_index=c.label_index)
        return self.model

    def score(self, samples: list[Sample]) -> list[float]:
        model = self.load()  # a model that does not load is a ConfigError: the run stops, whatever the policy
        try:
            values = model.score([(s.prompt, s.response) for s in samples])
            return finite_scores(values, len(samples), f"reward model {self.cfg.path}")
        except ValueError as e:
            raise ScorerFailed(str(e), range(len(samples))) from None

    def close(self) -> None:
        self.model = None
