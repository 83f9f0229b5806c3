"""The policy loss: PPO-clip (``algorithm.loss=ppo_clip``, a ratio per token) or GSPO
(``algorithm.loss=gspo``, one ratio per response: engine/algorithms/gspo.py), with KL to a
reference and an entropy bonus, aggregated over tokens the way the config asks, normalised over
the *global* mini-batch so that data parallel ranks and micro-batching give the same gradient as
one big batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.algorithms.gspo import gspo_token_loss, sequence_ratio_metrics
from engine.config.schema import AlgorithmConfig


def kl_penalty(log_p: torch.Tensor, log_ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators on sampled tokens (Schulman's k1/k3).

    k1 = log p - log ref;  k3 (= 'low_var_kl', clamped) = exp(ref - p) - (ref - p) - 1.
    """
    d = log_p - log_ref
    if kind == "k1":
        return d
    k3 = torch.exp(-d) + d - 1.0
    if kind == "low_var_kl":
        return k3.clamp(-10.0, 10.0)
    return k3


def ppo_clip_token_loss(log_p: torch.Tensor, old_log_p: torch.Tensor, adv: torch.Tensor,
                        clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(r A, clip(r, 1-lo, 1+hi) A) and whether the clip was active."""
    ratio = torch.exp(log_p - old_log_p)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()


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


@dataclass
class PolicyLoss:
    """The LossFn the engines call per micro-batch (see engine/backends/base.py)."""

    cfg: AlgorithmConfig
    world_size: int = 1

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.entropy_coef > 0

    @property
    def idle_rows_train_nothing(self) -> bool:
        """A row whose advantage is 0 everywhere gets no gradient: the PPO-clip (or GSPO) term is its
        only term unless KL is in the loss or there is an entropy bonus (engine/backends/zero_advantage.py)."""
        kl_in_loss = self.cfg.kl_coef > 0 and self.cfg.use_kl_loss
        return not kl_in_loss and self.cfg.entropy_coef == 0

    def __call__(self, log_p, entropy, mb, n_tokens: float, n_seqs: float):
        c = self.cfg
        mask = mb.response_mask
        old = mb.old_log_probs if mb.old_log_probs is not None else log_p.detach()
        agg = lambda v: aggregate(v, mask, c.loss_agg_mode, n_tokens, n_seqs)  # noqa: E731
        if c.loss == "gspo":
            terms = gspo_token_loss(log_p, old, mb.advantages, mask, c.gspo_clip_ratio_low, c.gspo_clip_ratio_high)
            pg, clipped = terms.loss, terms.clipped
            extra = sequence_ratio_metrics(terms, mask, n_seqs)
        else:
            pg, clipped = ppo_clip_token_loss(log_p, old, mb.advantages, c.clip_ratio_low, c.clip_ratio_high)
            extra = {}
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
