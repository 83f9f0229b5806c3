"""Self-normalised importance sampling per prompt group, for samples drawn by older weights
(``algorithm.off_policy_ratio=snis``, trainer.mode one_step_off/async; docs/async.md).

A group's responses y_1..y_n were sampled by the weights pi_b; the update trains pi_theta. Each
response's sequence ratio w_i = pi_theta(y_i) / pi_b(y_i), normalised within its group so the
weights sum to n (``group_weights``), turns the group's samples into an estimate under pi_theta:
the baseline sum_i w_i r_i / n and the std are the value and spread of the *trained* policy's
rewards (engine/algorithms/advantages.py), and each response's gradient counts w_i times
(``loss_weights``). A response sampled by the trained weights themselves (staleness 0) has w = 1,
so a group of such responses is plain GRPO, exactly.
"""

from __future__ import annotations

import torch


def group_weights(train_log_p: torch.Tensor, rollout_log_p: torch.Tensor, mask: torch.Tensor,
                  stale: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] weights ``n * softmax_i(log w_i)`` within each group of ``group_size`` consecutive rows
    (prompt-major), ``log w_i`` the sum over response tokens (``mask``) of the trained policy's
    log-probs (``train_log_p``, detached) minus the sampler's. Rows not ``stale`` ([B] bool: sampled
    by the trained weights) get ``log w = 0``: their sampler/trainer differences are numerics, not
    the policy's change."""
    log_w = ((train_log_p.float() - rollout_log_p.float()) * mask).sum(-1)
    log_w = torch.where(stale, log_w, torch.zeros_like(log_w))
    if log_w.numel() % group_size:
        raise ValueError(f"{log_w.numel()} rows do not split into groups of {group_size}")
    return (torch.softmax(log_w.view(-1, group_size), dim=1) * group_size).reshape(-1)


def effective_sample_size(weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] Kish's effective sample size (sum w)^2 / sum w^2 of each group, as a share of n:
    1 when every weight is 1, 1/n when one response holds all the weight."""
    w = weights.view(-1, group_size)
    return w.sum(1) ** 2 / (w * w).sum(1).clamp(min=1e-30) / group_size


def loss_weights(weights: torch.Tensor, mask: torch.Tensor, rows_per_mini_batch: int, agg_mode: str) -> torch.Tensor:
    """[B, T]: each response's weight on its tokens, scaled so the loss's aggregate is the weighted
    mean. token-mean divides by the mini-batch's token count N (engine/algorithms/policy_loss.py), so
    the weights of each mini-batch are scaled by N / sum_i w_i |y_i|: the loss is then
    sum_i w_i sum_t l_it / sum_i w_i |y_i|. The seq-mean modes divide by the number of responses,
    which the weights already sum to (n per group; mini-batches are whole groups)."""
    per_row = weights.float().clone()
    if agg_mode == "token-mean":
        lengths = mask.sum(-1)
        for start in range(0, len(per_row), rows_per_mini_batch):
            rows = slice(start, start + rows_per_mini_batch)
            weighted = (per_row[rows] * lengths[rows]).sum()
            if weighted > 0:
                per_row[rows] = per_row[rows] * (lengths[rows].sum() / weighted)
    return per_row[:, None] * mask
