"""GSPO: the sequence-level importance ratio and its clip (Zheng et al. 2025, *Group Sequence
Policy Optimization*, arXiv:2507.18071), as per-token values for ``aggregate``.

Response i of |y_i| tokens has one ratio, the geometric mean of its tokens' ratios:

    s_i = exp( (1/|y_i|) * sum_t (log pi(y_it) - log pi_old(y_it)) )

and GSPO maximises (1/G) sum_i min(s_i A_i, clip(s_i, 1 - lo, 1 + hi) A_i). Written per token
in the paper's GSPO-token form,

    s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]       (value s_i; d s_it / d log pi(y_it) = s_i)

    l_it = -min(s_it A_it, clip(s_it, 1 - lo, 1 + hi) A_it)

and aggregated ``seq-mean-token-mean``, its gradient is GSPO's exactly when the advantage is one
value per response (grpo, dr_grpo, rloo, dapo): d s_i / d log pi(y_it) = s_i / |y_i|, and the
token mean supplies the 1/|y_i|. With per-token advantages (ppo's GAE, reinforce_pp's returns)
it is GSPO-token, the paper's variant for them. Every row of a micro-batch holds its whole
response (micro-batches split rows, never a row; engine/batching/microbatch.py), so s_i is
computed where the loss is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sequence_log_ratio(log_p: torch.Tensor, old_log_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B]: (1/|y_i|) sum_t (log_p - old_log_p) over each row's response tokens (0 for a row with none)."""
    live = mask > 0
    diff = torch.where(live, log_p - old_log_p, torch.zeros_like(log_p))
    return diff.sum(-1) / live.sum(-1).clamp(min=1)


@dataclass
class GSPOTerms:
    """One micro-batch's GSPO values: per-token loss and clip indicator [B, T] (for ``aggregate``)
    and the sequence ratio s_i [B] (no grad)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    seq_ratio: torch.Tensor


def gspo_token_loss(log_p: torch.Tensor, old_log_p: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    clip_low: float, clip_high: float) -> GSPOTerms:
    """l_it = -min(s_it A_it, clip(s_it, 1 - clip_low, 1 + clip_high) A_it), s_it as in the module doc."""
    live = mask > 0
    log_s = sequence_log_ratio(log_p.detach(), old_log_p, mask)
    # log s_it = sg[log s_i] + log pi - sg[log pi]; off the response the ratio is s_i with no gradient
    # (where(): a -inf log-prob off the mask must not become nan)
    grad_path = torch.where(live, log_p - log_p.detach(), torch.zeros_like(log_p))
    s_tok = torch.exp(log_s[:, None] + grad_path)
    unclipped = -adv * s_tok
    clipped = -adv * s_tok.clamp(1.0 - clip_low, 1.0 + clip_high)
    return GSPOTerms(torch.maximum(unclipped, clipped), (clipped > unclipped).float(), log_s.exp())


def sequence_ratio_metrics(terms: GSPOTerms, mask: torch.Tensor, n_seqs: float) -> dict:
    """This micro-batch's shares of the step's sequence-ratio metrics: ``seq_ratio_mean`` (over the
    global mini-batch's ``n_seqs`` responses), ``seq_ratio_min``/``_max`` (combined as extremes,
    engine/metric_sums.py) and ``seq_clip_frac`` (the share of responses whose ratio was clipped; with
    per-token advantages, the mean over responses of their clipped tokens' share)."""
    has = mask.sum(-1) > 0
    if not bool(has.any()):
        return {"seq_ratio_mean": 0.0, "seq_clip_frac": 0.0}
    s = terms.seq_ratio[has]
    per_seq_clip = (terms.clipped * mask).sum(-1)[has] / mask.sum(-1)[has]
    return {"seq_ratio_mean": float(s.sum()) / max(n_seqs, 1.0), "seq_ratio_min": float(s.min()),
            "seq_ratio_max": float(s.max()), "seq_clip_frac": float(per_seq_clip.sum()) / max(n_seqs, 1.0)}
