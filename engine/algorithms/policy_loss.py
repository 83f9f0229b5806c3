"""The policy loss: PPO-clip (``algorithm.loss=ppo_clip``, a ratio per token) or GSPO
(``algorithm.loss=gspo``, one ratio per response: engine/algorithms/gspo.py), with KL to a
reference and an entropy bonus, aggregated over tokens the way the config asks, normalised over
the *global* mini-batch so that data parallel ranks and micro-batching give the same gradient as
one big batch."""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch

from engine.algorithms.gspo import gspo_token_loss, sequence_ratio_metrics
from engine.config.schema import AlgorithmConfig


def kl_penalty(log_p: torch.Tensor, log_ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators on tokens sampled from pi (Schulman, "Approximating KL
    divergence", 2020), with d = log p - log ref:

    k1 = d (unbiased value; as a loss its expected gradient is 0: refused there, policy_loss_rules);
    k2 = d^2 / 2 (as a loss, its expected gradient is exactly that of KL(pi || ref));
    k3 = exp(-d) + d - 1 (unbiased value, low variance; 'low_var_kl' clamps it to [-10, 10] as verl).

    d is clamped to [-20, 20] first (verl does for k3/low_var_kl): a padded position, whose reference log-prob is 0
    while the policy's may be below -88, would otherwise make exp(-d) infinite, and its gradient,
    masked afterwards, 0 x inf = NaN.
    """
    d = (log_p - log_ref).clamp(-20.0, 20.0)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    k3 = torch.exp(-d) + d - 1.0
    if kind == "low_var_kl":
        return k3.clamp(-10.0, 10.0)
    return k3


def batch_kl(batch, kind: str) -> torch.Tensor:
    """Per-token KL(sampler || reference) on ``batch``'s response tokens ([B, T], 0 elsewhere):
    what a KL term in the reward adds per token."""
    return kl_penalty(batch.rollout_log_probs, batch.ref_log_probs, kind) * batch.response_mask


def ppo_clip_token_loss(log_p: torch.Tensor, old_log_p: torch.Tensor, adv: torch.Tensor,
                        clip_low: float, clip_high: float,
                        versions_behind: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(r A, clip(r, 1-lo, 1+hi) A) and whether the clip was active.
    ``versions_behind`` [B, T] (a ratio against weights s versions older than the trained ones):
    the bounds compound per version, (1-lo)^(s+1) .. (1+hi)^(s+1). (dual_clip caps it further.)"""
    ratio = torch.exp((log_p - old_log_p).clamp(-20.0, 20.0))  # as verl: exp stays finite on any position
    unclipped = -adv * ratio
    if versions_behind is None:
        clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    else:
        span = versions_behind.to(ratio.dtype) + 1.0
        clipped = -adv * torch.clamp(ratio, (1.0 - clip_low) ** span, (1.0 + clip_high) ** span)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()


def dual_clip(loss: torch.Tensor, adv: torch.Tensor, clip_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"):
    where A < 0, the PPO-clip loss -min(r A, clip(r) A) grows with r without bound (the min keeps
    r A); it is capped at -c A, so a token whose ratio exceeds c -- one the trained policy already
    made far likelier than the weights that sampled it -- adds no gradient instead of one c-fold
    or more. Returns the loss and where the cap was active."""
    cap = -adv * clip_c
    capped = (adv < 0) & (loss > cap)
    return torch.where(capped, cap, loss), capped.float()


def rollout_is_weight(old_log_p: torch.Tensor, rollout_log_p: torch.Tensor, mask: torch.Tensor, level: str,
                      cap: float) -> torch.Tensor:
    """The truncated importance weight min(pi_old / pi_rollout, cap) per token (``level='token'``),
    or per response (``'sequence'``: the product of its tokens' ratios, the same weight on each of
    its tokens). ``old_log_p`` is the trainer's policy at the update (detached), ``rollout_log_p``
    the sampler's; only response tokens (``mask``) count. Decoupled PPO (Hilton et al. 2022; AReaL,
    verl's rollout_is): the clip ratio stays against pi_old, this weight corrects for the policy
    that actually sampled."""
    log_w = (old_log_p - rollout_log_p) * mask
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(mask)
    return torch.exp(log_w.clamp(max=math.log(cap))) * mask


def rollout_ratio_report(old_log_p: torch.Tensor, rollout_log_p: torch.Tensor, mask: torch.Tensor, cap: float,
                         n_tokens: float, n_seqs: float) -> dict:
    """Shares of the global token means of pi_old / pi_rollout and its square, its extremes on this
    micro-batch, and the share of tokens whose ratio exceeded ``cap`` (engine/algorithms/staleness.py)."""
    ratio = torch.exp((old_log_p - rollout_log_p) * mask)
    tok = lambda v: aggregate(v, mask, "token-mean", n_tokens, n_seqs).item()  # noqa: E731
    out = {"rollout_ratio_mean": tok(ratio), "rollout_ratio_sq_mean": tok(ratio * ratio),
           "rollout_is_truncated_frac": tok((ratio > cap).float())}
    picked = ratio[mask > 0]
    if picked.numel():
        out["rollout_ratio_min"], out["rollout_ratio_max"] = picked.min().item(), picked.max().item()
    return out


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, n_tokens: float, n_seqs: float) -> torch.Tensor:
    """Sum of this micro-batch's contribution to the global-mini-batch aggregate.

    token-mean:            sum(values * mask) / n_tokens          (all tokens weigh the same)
    seq-mean-token-mean:   sum_s [mean_t values_s] / n_seqs       (all sequences weigh the same)
    seq-mean-token-sum:    sum_s [sum_t values_s] / n_seqs        (Dr. GRPO)
    ``n_tokens``/``n_seqs`` are totals over the global mini-batch (all ranks, all micro-batches).
    """
    if mode == "token-mean":
        return (values * mask).sum() / max(n_tokens, 1.0)
    per_seq_sum = (values * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq_sum / mask.sum(-1).clamp(min=1.0)
        return (per_seq * (mask.sum(-1) > 0)).sum() / max(n_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / max(n_seqs, 1.0)
    raise ValueError(f"unknown loss_agg_mode {mode}")


@dataclass(frozen=True)
class OffPolicy:
    """How the loss treats samples from other weights than the ones trained (engine/config/resolved.py
    resolves it from trainer.mode and algorithm.rollout_is / off_policy_ratio)."""

    is_level: str = "off"         # truncated importance weight pi_old / pi_rollout: off, token, sequence
    behavior_ratio: bool = False  # PPO's ratio and clip against the sampler's log-probs
    report: bool = False          # report pi_theta / pi_rollout's mean, spread and range (rollouts sampled ahead)


@dataclass
class PolicyLoss:
    """The LossFn the engines call per micro-batch (see engine/backends/base.py)."""

    cfg: AlgorithmConfig
    world_size: int = 1
    off_policy: OffPolicy = OffPolicy()

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.entropy_coef > 0

    @property
    def idle_rows_train_nothing(self) -> bool:
        """A row whose advantage is 0 everywhere gets no gradient: the PPO-clip (or GSPO) term is its
        only term unless KL is in the loss or there is an entropy bonus (engine/backends/zero_advantage.py)."""
        kl_in_loss = self.cfg.kl_coef > 0 and self.cfg.use_kl_loss
        return not kl_in_loss and self.cfg.entropy_coef == 0

    @property
    def denominator(self) -> str:
        """The global count the loss is divided by: ``tokens`` (token-mean) or ``seqs``."""
        return "tokens" if self.cfg.loss_agg_mode == "token-mean" else "seqs"

    def metric_denominator(self, key: str) -> str | None:
        """The global count ``__call__`` divided metric ``key`` by (``tokens``, ``seqs``), or None
        for an extreme (``*_min``/``*_max``) or an engine's count (``rows_skipped``). A streamed
        update (trainer.mode=streamed) takes the loss with both counts at 1 and divides after the
        last chunk; a metric this does not know is an error, never a silently wrong mean."""
        if key.endswith(("_min", "_max")) or key == "rows_skipped":
            return None
        if key in ("pg_loss", "clip_frac", "dual_clip_frac", "rollout_kl", "kl"):  # through agg()
            return self.denominator
        if key in ("entropy", "rollout_ratio_mean", "rollout_ratio_sq_mean", "rollout_is_truncated_frac"):
            return "tokens"  # token means whatever the loss aggregation
        if key in ("seq_ratio_mean", "seq_clip_frac"):  # GSPO's sequence_ratio_metrics
            return "seqs"
        raise KeyError(f"PolicyLoss.metric_denominator: no rule for metric {key!r}")

    def __call__(self, log_p, entropy, mb, n_tokens: float, n_seqs: float):
        c = self.cfg
        mask = mb.response_mask
        old = mb.old_log_probs if mb.old_log_probs is not None else log_p.detach()
        off, roll = self.off_policy, mb.rollout_log_probs
        if off.behavior_ratio and roll is not None:  # stale samples: clip against the sampler
            old = torch.where(mask > 0, roll, old)
        agg = lambda v: aggregate(v, mask, c.loss_agg_mode, n_tokens, n_seqs)  # noqa: E731
        if c.loss == "gspo":
            terms = gspo_token_loss(log_p, old, mb.advantages, mask, c.gspo_clip_ratio_low, c.gspo_clip_ratio_high)
            pg, clipped = terms.loss, terms.clipped
            extra = sequence_ratio_metrics(terms, mask, n_seqs)
        else:
            behind = (mb.versions_behind if off.behavior_ratio and roll is not None and c.behavior_clip == "per_version"
                      else None)
            pg, clipped = ppo_clip_token_loss(log_p, old, mb.advantages, c.clip_ratio_low, c.clip_ratio_high, behind)
            extra = {}
            if c.clip_ratio_c > 0:
                pg, capped = dual_clip(pg, mb.advantages, c.clip_ratio_c)
                extra["dual_clip_frac"] = agg(capped).item()
        if roll is not None and (off.report or off.is_level != "off"):  # the trained policy against the sampler's
            with torch.no_grad():
                extra |= rollout_ratio_report(log_p.detach(), roll, mask, c.rollout_is_cap, n_tokens, n_seqs)
        if off.is_level != "off" and roll is not None:  # decoupled PPO: weigh by pi_old / pi_rollout, truncated
            with torch.no_grad():
                weight = rollout_is_weight(old.detach(), roll, mask, off.is_level, c.rollout_is_cap)
            pg = pg * weight
        total = agg(pg)
        metrics = {"pg_loss": total.item(), "clip_frac": agg(clipped).item(), **extra}
        if mb.rollout_log_probs is not None:  # how far the sampler's log-probs are from the trainer's
            with torch.no_grad():
                metrics["rollout_kl"] = agg(kl_penalty(mb.rollout_log_probs, log_p.detach(), "k3")).item()
        if c.kl_coef > 0 and c.use_kl_loss and mb.ref_log_probs is not None:
            kl = agg(kl_penalty(log_p, mb.ref_log_probs, c.kl_type))
            total = total + c.kl_coef * kl
            metrics["kl"] = kl.item()
        if entropy is not None:
            ent = agg(entropy)
            # the metric is per token whatever the loss aggregation (seq-mean-token-sum would report
            # a per-response sum, and entropy alarms compare per-token values)
            metrics["entropy"] = aggregate(entropy.detach(), mask, "token-mean", n_tokens, n_seqs).item()
            if c.entropy_coef > 0:
                total = total - c.entropy_coef * ent
        # ranks' gradients are averaged by the data-parallel reduction: undo that mean so
        # the result is the global-batch aggregate.
        return total * self.world_size, metrics
