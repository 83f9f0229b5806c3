"""GRPO advantages: rewards normalised within each prompt's group of samples."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """rewards [B] ordered prompt-major (B = prompts x group_size) -> advantages [B].

    A_i = (r_i - mean(group)) / (std(group) + eps)   (std: unbiased, as in GRPO/verl)
    With norm_by_std=False (Dr. GRPO) only the group mean is subtracted. A group of one
    sample has advantage 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def token_advantages(seq_adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence onto its response tokens: [B] -> [B, T]."""
    return seq_adv[:, None] * response_mask
