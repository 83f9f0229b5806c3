"""GRPO advantages: rewards normalised within each prompt's group of samples."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """rewards [B] ordered prompt-major (B = prompts x group_size) -> advantages [B].

    A_i = (r_i - mean(group)) / (std(group) + eps)   (std: unbiased, as in GRPO/verl)
    With norm_by_std=False (Dr. GRPO) only the group mean is subtracted. A group of one
    sample, and a group whose rewards are all equal, has advantage exactly 0: computed, a group
    of 0.7s has a float32 mean one ulp off 0.7 and a std of ~6e-8, and (r - mean) / (std + eps)
    would give every sample the same advantage of ~0.06 (a push on all of them that no reward
    asked for; verl's formula has it).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    flat = zero_variance_groups(rewards, group_size)[:, None]
    return torch.where(flat, 0.0, centred).reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int, eps: float = 1e-8) -> torch.Tensor:
    """[B] -> [prompts] bool: True for groups whose rewards are all equal (no learning signal)."""
    r = rewards.float().view(-1, group_size)
    return (r.max(dim=1).values - r.min(dim=1).values) <= eps


def token_advantages(seq_adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence onto its response tokens: [B] -> [B, T]."""
    return seq_adv[:, None] * response_mask
