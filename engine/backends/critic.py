"""The PPO critic's update, written once: a value model trained beside the policy, on the
policy engine's micro-batches and through its update loop (``TrainEngine.accumulate_and_step``).

A backend supplies the network and its optimizer (FSDP2: engine/backends/fsdp/critic.py;
Megatron: engine/backends/megatron/critic.py) and ``_forward`` (ids -> values per position);
the value alignment (``values[:, t]`` is V(tokens < t)) and the clipped value loss are
engine/algorithms/value_loss.py. The value head starts at zero, so the first advantages are
plain (whitened) returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.algorithms.value_loss import value_loss
from engine.backends.base import global_counts
from engine.batch import SequenceBatch


class Critic(ABC):
    """Built on every rank next to the engine whose micro-batches, groups and hooks it uses.
    Subclasses set ``model`` and ``step_optimizer`` (what the engine's ``_clip_and_step``
    steps) in ``__init__``."""

    model: torch.nn.Module
    step_optimizer = None

    def __init__(self, cfg, engine):
        self.cfg, self.engine = cfg, engine

    @abstractmethod
    def _forward(self, batch: SequenceBatch) -> torch.Tensor:
        """[B, T] values per position of ``batch`` (on the engine's device)."""

    @abstractmethod
    def param_count(self) -> int:
        """Parameters of the value model (all of them, over every shard)."""

    @abstractmethod
    def checkpoint_state(self, for_save: bool = False) -> dict:
        """DCP-saveable {"model", "optim"} (inside the engine's state, under "critic"); ``for_save``
        as TrainEngine.checkpoint_state."""

    @abstractmethod
    def load_checkpoint_state(self, state: dict) -> None:
        """Apply what DCP loaded into ``checkpoint_state()``'s structure."""

    @torch.no_grad()
    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        """V per position, [B, T], 0 outside the response."""
        self.model.eval()
        self.engine._begin_pass(self.model)
        B, T = batch.input_ids.shape
        out = torch.zeros(B, T)
        for mb in self.engine._micro_batches(batch, observe=False):
            v = self._forward(mb.batch)
            k, real = mb.num_rows, mb.indices >= 0  # -1: a zero-weight twin (engine/backends/fsdp)
            t = min(T, v.shape[1])
            out[mb.indices[real], :t] = v[:k][real, :t].float().cpu()
        return out * batch.response_mask

    def train_step(self, batch: SequenceBatch) -> dict:
        """One optimizer step of the critic on this rank's share of a mini-batch (needs
        ``batch.values`` and ``batch.returns``). Returns partial sums of its metrics."""
        e = self.engine
        self.model.train()
        n_tokens, _ = global_counts(batch, e.dp_group, e.dp_size)
        dev = e.device

        def loss_of(mb, _layout):
            b = mb.batch
            loss, clipped = value_loss(self._forward(b), b.values.to(dev), b.returns.to(dev),
                                       b.response_mask.to(dev), self.cfg.critic.cliprange_value, n_tokens)
            # x dp_size: undo the data-parallel mean of gradients (engine/interfaces.py)
            return loss * e.dp_size, {"value_loss": loss.item(), "value_clip_frac": clipped.item()}

        sums = {"value_loss": 0.0, "value_clip_frac": 0.0}
        mbs = [(mb, None) for mb in e._micro_batches(batch, observe=False)]
        norm, finite = e.accumulate_and_step(self.model, self.step_optimizer, mbs, loss_of, sums,
                                             self.cfg.critic.grad_clip)
        return {"metrics": sums, "replicated": {"value_grad_norm": norm,
                                                "value_nonfinite_updates": 0.0 if finite else 1.0}}
