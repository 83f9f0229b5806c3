"""Rows that train nothing, and the update that skips their backward.

A row whose advantage is 0 on every response token (every GRPO/RLOO group whose samples all
scored the same: all wrong early in a run, all right late, common with 0/1 rewards) adds exactly
nothing to the PPO-clip loss or its gradient: -0 * ratio is 0 whatever the ratio. When the loss
has no other per-token term (no KL in the loss, no entropy bonus), the update's gradient,
clipping and optimizer step are the same with or without those rows, as long as the loss keeps
its denominators (the response tokens and sequences of the whole mini-batch, which the engine
counts before skipping). So the engine runs the forward and backward on the other rows only.

The step's metrics stay those of every row: the skipped rows' entropy and rollout-vs-trainer
KL come from one no-grad forward (a third of a forward+backward), through the same loss
function. ``engine.skip_zero_advantage_rows=false`` turns this off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import SequenceBatch


def trains_nothing(batch: SequenceBatch) -> torch.Tensor:
    """[B] bool: rows whose advantage is exactly 0 on every response token (or that have none)."""
    if batch.advantages is None:
        return torch.zeros(len(batch), dtype=torch.bool)
    live = (batch.advantages != 0) & (batch.response_mask > 0)
    return ~live.any(dim=-1)


@dataclass
class RowSplit:
    """This rank's rows of one mini-batch: those the update trains on and those it skips."""

    train: list[int]
    skip: list[int]


def split_rows(batch: SequenceBatch, enabled: bool) -> RowSplit:
    """Which rows to train on. At least one row is always trained, so that every rank runs
    its forward and backward (FSDP's collectives) even when all of its rows are idle; that
    row's contribution is zero anyway."""
    if not enabled or len(batch) == 0:
        return RowSplit(list(range(len(batch))), [])
    idle = trains_nothing(batch).tolist()
    train = [i for i, z in enumerate(idle) if not z]
    skip = [i for i, z in enumerate(idle) if z]
    if not train:
        train, skip = skip[:1], skip[1:]
    return RowSplit(train, skip)


def skippable(loss_fn) -> bool:
    """Whether ``loss_fn`` gives an idle row no gradient: it says so (PolicyLoss does unless a
    KL or entropy term is in the loss)."""
    return bool(getattr(loss_fn, "idle_rows_train_nothing", False))
