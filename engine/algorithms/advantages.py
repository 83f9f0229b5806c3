"""GRPO advantages: rewards normalised within each prompt's group of samples."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6, weights: torch.Tensor | None = None) -> torch.Tensor:
    """rewards [B] ordered prompt-major (B = prompts x group_size) -> advantages [B].

    A_i = (r_i - mean(group)) / (std(group) + eps)   (std: unbiased, as in GRPO/verl)
    With norm_by_std=False (Dr. GRPO) only the group mean is subtracted. A group of one
    sample has advantage 0.
    ``weights`` [B] (each group's summing to group_size: engine/algorithms/snis.py): the mean and
    std are the weighted ones, sum_i w_i r_i / n and sqrt(sum_i w_i (r_i - mean)^2 / (n - 1)),
    estimates under the policy the weights point to; all weights 1 is the unweighted formula.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    if weights is None:
        mean, std = r.mean(dim=1, keepdim=True), (r.std(dim=1, keepdim=True) if norm_by_std else None)
    else:
        w = weights.float().view(-1, group_size)
        mean = (w * r).sum(dim=1, keepdim=True) / group_size
        std = ((w * (r - mean) ** 2).sum(dim=1, keepdim=True) / (group_size - 1)).sqrt() if norm_by_std else None
    centred = r - mean
    if norm_by_std:
        centred = centred / (std + eps)
    return centred.reshape(-1)


def token_advantages(seq_adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence onto its response tokens: [B] -> [B, T]."""
    return seq_adv[:, None] * response_mask
