"""Advantage estimators, each a small pure function on plain tensors, and the one
dispatcher the trainer calls (``compute_advantages``).

Shapes: ``rewards`` [B] one scalar per response, ordered prompt-major (B = prompts x n);
``mask`` [B, T] 1 on response tokens; token tensors are [B, T] in the batch's layout
(prompt then response, right-padded). Papers: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.algorithms.advantages import grpo_advantages, token_advantages, zero_variance_groups


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): baseline = mean of the *other* n-1 samples of the prompt.

    A_i = r_i - (sum_j r_j - r_i) / (n - 1)  =  n/(n-1) * (r_i - mean(group)).
    A group of one sample has advantage 0 (no other sample to compare with), and so has a group
    whose rewards are all equal (exactly: not the ulp a float32 sum can leave).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    r = rewards.float().view(-1, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    flat = zero_variance_groups(rewards, group_size)[:, None]
    return torch.where(flat, 0.0, r - others).reshape(-1)


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: each response's scalar reward on its last response token, 0 elsewhere."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    has = mask.sum(-1) > 0
    last = (mask * torch.arange(mask.shape[1], dtype=torch.float32)).argmax(-1)
    rows = torch.arange(mask.shape[0])[has]
    out[rows, last[has]] = rewards.float()[has]
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s-t) r_s over each row's response tokens (0 off the mask).

    The sum runs over the row's *masked* tokens only, to the row's last one: in a multi-turn row
    the environment's tokens between two model turns (mask 0) are skipped, not an end of the
    episode, so a turn's tokens are credited with what the later turns earn (the outcome reward
    sits on the last model token)."""
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0])
    on = mask > 0
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(on[:, t], token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * mask[:, t]
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole batch (std: unbiased), 0 off the mask."""
    m = mask.float()
    n = m.sum()
    mean = (values * m).sum() / n.clamp(min=1)
    var = (((values - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    out = (values - mean) if shift_mean else values
    return out * torch.rsqrt(var + eps) * m


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                            kl_coef: float = 0.0, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): token rewards = outcome reward on the last token minus
    kl_coef * KL_t on every token; advantages = discounted returns, normalised over the
    *whole batch's* tokens (no per-prompt baseline, no critic)."""
    tok = outcome_token_rewards(rewards, mask)
    if kl is not None and kl_coef:
        tok = tok - kl_coef * kl * mask
    return whiten(discounted_returns(tok, mask, gamma), mask)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's response tokens.

    delta_t = r_t + gamma V_next - V_t;   A_t = delta_t + gamma lam A_next;   returns_t = A_t + V_t,
    where "next" is the row's next *masked* token (V = 0, A = 0 past its last one). In a
    multi-turn row the environment's tokens between model turns (mask 0) are skipped: the last
    token of a turn bootstraps from the first token of the next turn, not from an episode end
    (as verl's compute_gae_advantage_return). Returns (advantages, returns), both 0 off the mask.
    """
    B, T = mask.shape
    m = mask.float()
    v = values.float() * m
    adv = torch.zeros(B, T)
    next_v = torch.zeros(B)
    next_adv = torch.zeros(B)
    for t in reversed(range(T)):
        a = token_rewards[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_adv
        mt = m[:, t]
        next_adv = mt * a + (1.0 - mt) * next_adv
        next_v = mt * v[:, t] + (1.0 - mt) * next_v
        adv[:, t] = a * mt
    return adv, (adv + v) * m


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max_len - buffer_len, then a linear ramp to
    -factor at max_len (and -factor beyond). [B] lengths -> [B] penalties (<= 0)."""
    if buffer_len <= 0:
        return torch.zeros(response_lengths.shape[0])
    start = max_len - buffer_len
    over = (response_lengths.float() - start).clamp(min=0)
    return -factor * (over / buffer_len).clamp(max=1.0)


def turn_runs(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: at each response token, how many response tokens in a row end there (0
    off the mask). A single-turn row has one run, its response; a multi-turn row one per model turn
    (the environment's tokens between them have mask 0), each sampled under
    rollout.max_new_tokens on its own."""
    on = mask > 0
    idx = torch.arange(mask.shape[1]).expand(mask.shape[0], -1)
    last_off = torch.cummax(torch.where(on, -1, idx), dim=1).values  # the latest position off the mask
    return (idx - last_off) * on


def longest_turn(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: each row's longest model turn (its response length, single-turn)."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0])
    return turn_runs(mask).max(dim=1).values.float()


@dataclass
class Advantages:
    """What the advantage step hands the update: token advantages, and for PPO the value
    targets the critic regresses on."""

    advantages: torch.Tensor                 # [B, T]
    returns: torch.Tensor | None = None      # [B, T] (PPO)
    metrics: dict = field(default_factory=dict)


def compute_advantages(cfg, rewards: torch.Tensor, mask: torch.Tensor, group_size: int,
                       kl: torch.Tensor | None = None, values: torch.Tensor | None = None,
                       max_len: int = 0) -> Advantages:
    """The advantage step for ``cfg.name`` (an AlgorithmConfig).

    With ``cfg.overlong_buffer_len`` the rewards first get DAPO's soft overlong penalty
    (responses near ``max_len`` = rollout.max_new_tokens tokens, the limit of one sampling call:
    in a multi-turn row, its longest model turn), whatever the estimator.

    ``kl`` [B, T]: per-token KL(policy || reference) on the sampled tokens, when a reference
    exists; it enters the *reward* (REINFORCE++, PPO, and any estimator with
    use_kl_loss=false), never both reward and loss. ``values`` [B, T]: the critic's (PPO).
    """
    name = cfg.name
    kl_in_reward = kl is not None and cfg.kl_coef > 0 and not cfg.use_kl_loss
    metrics: dict = {}
    if cfg.overlong_buffer_len:
        pen = overlong_penalty(longest_turn(mask), max_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        rewards = rewards.float() + pen
        metrics["overlong_penalty"] = float(pen.mean())
    if kl is not None:
        metrics["kl_reward"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
    if group_size > 1 and rewards.numel() % group_size == 0:  # TRL's name: groups that teach a group baseline nothing
        metrics["frac_reward_zero_std"] = float(zero_variance_groups(rewards, group_size).float().mean())
    if name == "reinforce_pp":
        adv = reinforce_pp_advantages(rewards, mask, kl if kl_in_reward else None, cfg.kl_coef, cfg.gamma)
        return Advantages(adv, metrics=metrics)
    if name == "ppo":
        if values is None:
            raise ValueError("algorithm.name=ppo needs the critic's values")
        tok = outcome_token_rewards(rewards, mask)
        if kl_in_reward:
            tok = tok - cfg.kl_coef * kl * mask
        adv, ret = gae(tok, values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = whiten(adv, mask)
        metrics["value_mean"] = float((values * mask).sum() / mask.sum().clamp(min=1))
        return Advantages(adv, ret, metrics)
    if name == "rloo":
        seq = rloo_advantages(rewards, group_size)
    elif name in ("grpo", "dapo"):
        seq = grpo_advantages(rewards, group_size, cfg.norm_adv_by_std)
    elif name == "dr_grpo":
        seq = grpo_advantages(rewards, group_size, False)
    else:
        raise ValueError(f"unknown algorithm.name {name!r}")
    adv = token_advantages(seq, mask)
    if kl_in_reward:
        # the KL as a reward: every token is credited with the penalty of the tokens it leads to
        # (the reward-to-go sum_{s >= t} kl_s, as the returns of reinforce_pp and ppo), since
        # choosing token t changes the KL of every later one; earlier tokens' KL does not depend
        # on it, so it is left out. Not group-normalised: its weight is kl_coef per token, so
        # it grows with the response's length (verl instead subtracts the whole response's KL
        # from the score before the group normalisation, which divides it by the group's std)
        adv = adv - cfg.kl_coef * discounted_returns(kl * mask, mask, 1.0)
    return Advantages(adv, metrics=metrics)
