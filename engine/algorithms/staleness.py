"""What a step trained on when rollouts run ahead (trainer.mode=one_step_off|async): how stale its
samples were, and how far the trainer's policy had moved from the one that sampled them.

A sample of policy version ``v`` trained at step ``k`` (on weights of version ``k - 1``) is
``(k - 1) - v`` versions stale (engine/trainer/rollout_ahead.py)."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver imports this before it starts the ranks; torch loads after (trainer.py)
    import torch


def staleness_record(versions: list[int], step: int) -> dict:
    """The step's ``staleness`` row: the version trained from, the mean and largest staleness over
    its samples, and how many samples had each staleness (``rows_<s>``)."""
    trained_from = step - 1
    stale = [trained_from - v for v in versions]
    out = {"policy_version": trained_from, "mean": sum(stale) / max(len(stale), 1), "max": max(stale, default=0),
           "min_sample_version": min(versions, default=trained_from)}
    for s, count in sorted(Counter(stale).items()):
        out[f"rows_{s}"] = count
    return out


def versions_behind(versions: list[int], step: int, like: torch.Tensor) -> torch.Tensor:
    """[B, T] (shaped as ``like``): each row's staleness at step ``step`` on every token, as the
    policy loss reads it (algorithm.behavior_clip=per_version)."""
    import torch

    stale = torch.tensor([float((step - 1) - v) for v in versions], dtype=like.dtype)
    return stale[:, None].expand_as(like).contiguous()


def rollout_ratio_metrics(per_update: dict) -> dict:
    """The importance ratio pi_train / pi_rollout on sampled tokens (the policy loss reports its
    token mean, mean square, extremes and truncated share): its mean, spread and range."""
    if "rollout_ratio_mean" not in per_update:
        return {}
    mean = per_update["rollout_ratio_mean"]
    var = per_update.get("rollout_ratio_sq_mean", mean * mean) - mean * mean
    out = {"rollout_ratio_mean": mean, "rollout_ratio_std": math.sqrt(max(var, 0.0))}
    for key in ("rollout_ratio_min", "rollout_ratio_max", "rollout_is_truncated_frac"):
        if key in per_update:
            out[key] = per_update[key]
    return out
