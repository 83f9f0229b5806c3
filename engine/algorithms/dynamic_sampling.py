"""DAPO dynamic sampling: keep only prompt groups whose rewards differ (a group whose n
samples all score the same has zero advantage everywhere and teaches nothing), and refill
the batch from further prompts until it again holds ``target`` groups.

The batch size the update sees stays constant: after ``max_rounds`` extra rollouts that
still leave it short, it is topped up with zero-variance groups (they cost compute but
change nothing), and the step reports how many it had to use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.algorithms.estimators import zero_variance_groups
from engine.batch import SequenceBatch


@dataclass
class Rollout:
    """Rows of one or more rollouts, prompt-major: ``len(rewards) == groups * n``."""

    batch: SequenceBatch
    rewards: torch.Tensor                  # [B] task rewards
    correct: list | None = None            # [B] bools, when the task defines correctness
    examples: list = field(default_factory=list)   # [prompts] the task examples, in order
    versions: list = field(default_factory=list)   # [B] the policy version each row was sampled with

    def groups(self, idx: list[int], n: int) -> "Rollout":
        rows = [g * n + j for g in idx for j in range(n)]
        return Rollout(self.batch.select(rows), self.rewards[rows],
                       [self.correct[r] for r in rows] if self.correct is not None else None,
                       [self.examples[g] for g in idx] if self.examples else [],
                       [self.versions[r] for r in rows] if self.versions else [])

    @staticmethod
    def concat(parts: list["Rollout"], pad_token_id: int = 0) -> "Rollout":
        parts = [p for p in parts if len(p.rewards)]
        correct = None if any(p.correct is None for p in parts) else [c for p in parts for c in p.correct]
        return Rollout(SequenceBatch.concat([p.batch for p in parts], pad_token_id),
                       torch.cat([p.rewards for p in parts]), correct,
                       [e for p in parts for e in p.examples],
                       [] if any(not p.versions for p in parts) else [v for p in parts for v in p.versions])


@dataclass
class DynamicSamplingStats:
    rounds: int                 # rollouts made this step (1 = the first batch was enough)
    prompts_drawn: int          # prompt groups generated in all rounds
    kept_frac: float            # share of drawn groups with non-zero reward variance
    padded_groups: int          # zero-variance groups used to top the batch up (0 when filled)


def next_draw_size(target: int, have: int, good: int, drawn: int) -> int:
    """Prompts to draw next: the groups still missing scaled by the keep rate seen so far (at least
    1 / target), at most ``target``."""
    return min(target, math.ceil((target - have) / max(good / drawn, 1.0 / target)))


def dynamic_sample(draw: Callable[[int], Rollout], target: int, n: int, max_rounds: int,
                   pad_token_id: int = 0) -> tuple[Rollout, DynamicSamplingStats]:
    """Call ``draw(k)`` (k prompts -> their k*n sampled, rewarded rows) until ``target``
    groups with non-zero reward variance are collected, at most ``1 + max_rounds`` times;
    return exactly ``target`` groups. Later draws ask for the missing groups scaled by the
    keep rate seen so far (at most ``target`` prompts per draw)."""
    kept: list[Rollout] = []
    flat: list[Rollout] = []
    have = drawn = good = rounds = 0
    k = target
    while have < target and rounds < 1 + max_rounds:
        ro = draw(k)
        rounds += 1
        drawn += k
        zero = zero_variance_groups(ro.rewards, n)
        ok = [g for g in range(k) if not zero[g]]
        good += len(ok)
        take = ok[:target - have]
        if take:
            kept.append(ro.groups(take, n))
            have += len(take)
        flat.append(ro.groups([g for g in range(k) if zero[g]], n))
        k = next_draw_size(target, have, good, drawn)
    padded = 0
    if have < target:  # out of rounds: top up with groups that carry no signal
        spare = Rollout.concat(flat, pad_token_id)
        padded = target - have
        kept.append(spare.groups(list(range(padded)), n))
    out = Rollout.concat(kept, pad_token_id)
    return out, DynamicSamplingStats(rounds, drawn, good / drawn, padded)
