"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds a slice
of the vocabulary), without ever gathering the full [tokens, vocab] logits.

One autograd function computes both, with three all-reduces over the tensor-parallel group
(max, sum of exps, and the target logit / expected logit). The backward is local: with the
global log-normaliser and entropy saved, d logp/d l_v = 1[v = target] - p_v and
d H/d l_v = -p_v (log p_v + H), so each rank produces the gradient of its own slice.

Vocabulary rows added only to make the vocab split evenly (``padded_vocab_size``) are
excluded: their probability is exactly 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, vocab_size: int, group, with_entropy: bool):
        n, v_local = logits.shape
        cols = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
        pad = cols >= vocab_size                                   # [V_local]
        masked = logits.masked_fill(pad, float("-inf"))
        m = masked.max(-1).values
        m = _all_reduce(m, dist.ReduceOp.MAX, group)
        sum_exp = (masked - m[:, None]).exp().sum(-1)
        sum_exp = _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        lse = sum_exp.log() + m                                    # [N], same on every TP rank
        in_range = (target >= vocab_start) & (target < vocab_start + v_local)
        local_idx = (target - vocab_start).clamp(0, v_local - 1)
        tgt = logits.gather(-1, local_idx[:, None]).squeeze(-1) * in_range
        red = [tgt]
        p = None
        if with_entropy:
            p = (masked - lse[:, None]).exp()                      # 0 on padded columns
            red.append((p * logits.masked_fill(pad, 0.0)).sum(-1))
        red_t = _all_reduce(torch.stack(red), dist.ReduceOp.SUM, group)
        logp = red_t[0] - lse
        ent = (lse - red_t[1]) if with_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(logits, lse, ent, local_idx, in_range, pad)
        ctx.with_entropy = with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, lse, ent, local_idx, in_range, pad = ctx.saved_tensors
        logp_all = logits - lse[:, None]
        p = logp_all.exp().masked_fill(pad, 0.0)
        grad = -p * g_logp[:, None]
        grad.scatter_add_(-1, local_idx[:, None], (g_logp * in_range)[:, None])
        if ctx.with_entropy and g_ent is not None:
            grad = grad - p * (logp_all.masked_fill(pad, 0.0) + ent[:, None]) * g_ent[:, None]
        return grad, None, None, None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_size: int,
                             group=None, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V_local] (float32 recommended), target [...] global token ids ->
    (log p(target) [...], entropy [...] or None). Differentiable in ``logits``."""
    shape = target.shape
    lp, ent = _LogProbEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                    vocab_start, vocab_size, group, with_entropy)
    return lp.reshape(shape), (ent.reshape(shape) if with_entropy else None)


def token_log_probs_tp(logits: torch.Tensor, input_ids: torch.Tensor, vocab_start: int, vocab_size: int,
                       group=None, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Vocab-parallel twin of ``engine.algorithms.logprobs.token_log_probs``: logits
    [B, T, V_local] (position t predicts token t+1) -> [B, T] with 0 at t=0."""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    lp, ent = vocab_parallel_log_probs(logits, input_ids[:, 1:], vocab_start, vocab_size, group, with_entropy)
    lp = torch.nn.functional.pad(lp, (1, 0))
    if ent is not None:
        ent = torch.nn.functional.pad(ent, (1, 0))
    return lp, ent
