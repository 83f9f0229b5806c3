"""Per-token log-probs and entropy from logits, a few token positions at a time.

The plain way, ``log_softmax(logits.float())`` then gather, holds several [tokens, vocab] fp32
tensors at once and keeps two of them for backward (the log-softmax, and its exp for the
entropy). At a 49k-152k vocabulary that is the largest buffer of the update: SmolLM2-135M in
bf16 with 4k-token micro-batches spends more on it than on all its layers' activations.

Here one autograd function saves only the logits themselves, in their own dtype (a bf16 model:
2 B per element, not 8-16), plus three numbers per position (log-normaliser, target logit,
entropy). Forward and backward walk ``chunk_tokens`` positions at a time in fp32, so the fp32
working set is [chunk_tokens, vocab], whatever the micro-batch. The backward is the formula:
with z = logits / T, p = softmax(z), H = -sum p log p,

    d log p(y) / d z_v = 1[v = y] - p_v,        d H / d z_v = -p_v (log p_v + H),

so it needs no graph of the forward. verl (``entropy_from_logits_with_chunking``) and Liger's
fused cross-entropy cut the same buffer; this keeps the model's own lm_head call, so FSDP2 and
megatron gather and shard its weight exactly as before.

Vocab-parallel logits (megatron tensor parallelism: each rank holds the columns
[vocab_start, vocab_start + V_local)) take a ``group``: each rank computes its slice's
log-normaliser, target logit and expected logit per position, and three all-reduces of [tokens]
vectors combine them, however many chunks. Columns past ``vocab_size`` (megatron pads the
vocabulary to split evenly) have probability exactly 0. The backward is local to each rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 1024


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scaled(x: torch.Tensor, temperature: float, pad: torch.Tensor | None) -> torch.Tensor:
    """A new fp32 tensor z = x / T, -inf on padded vocabulary columns."""
    z = x.float()
    z = z / temperature if temperature != 1.0 else z.clone() if z is x else z
    return z.masked_fill_(pad, float("-inf")) if pad is not None else z


def _chunk_stats(z: torch.Tensor, idx: torch.Tensor, pad, with_entropy: bool):
    """One chunk's (log-normaliser, target value, entropy or None) from z (fp32, scaled, -inf on
    padded columns; overwritten)."""
    m = z.amax(-1, keepdim=True)
    e = (z - m).exp_()
    s = e.sum(-1)
    lse = m.squeeze(-1) + s.log()
    tgt = z.gather(-1, idx[:, None]).squeeze(-1)
    ent = None
    if with_entropy:  # -sum p log p, p = e / s: no cancellation as in lse - sum p z
        logp_all = z.sub_(lse[:, None])
        if pad is not None:
            logp_all.masked_fill_(pad, 0.0)  # p = 0 there; 0 * -inf would be nan
        ent = -(e.unsqueeze(1) @ logp_all.unsqueeze(2)).view(-1) / s
    return lse, tgt, ent


def _chunk_grad(z: torch.Tensor, lse, ent, g_logp, g_ent, idx, in_range, pad, temperature: float):
    """d(sum g_logp log p(target) + g_ent H) / d logits for one chunk, fp32 (z as in
    ``_chunk_stats``, overwritten; ``g_ent`` None: no entropy term)."""
    logp_all = z.sub_(lse[:, None])
    p = logp_all.exp()                            # 0 on padded columns
    # coef_v = g_logp + g_ent (log p_v + H): the common factor of -p_v in both formulas
    if g_ent is not None:
        coef = logp_all.add_(ent[:, None])
        if pad is not None:
            coef.masked_fill_(pad, 0.0)
        coef.mul_(g_ent[:, None].float()).add_(g_logp[:, None])
    else:
        coef = g_logp[:, None]
    g = p.mul_(coef).neg_()
    del logp_all, coef
    g.scatter_add_(-1, idx[:, None], (g_logp * in_range)[:, None])
    return g.div_(temperature) if temperature != 1.0 else g


def _outputs(ctx, lse, tgt, ent, in_range, group, with_entropy: bool, entropy_grad: bool):
    """log p(target) and the entropy, over every rank's columns; marks a metric entropy."""
    tgt = torch.where(in_range, tgt, 0.0)
    if group is not None and dist.get_world_size(group) > 1:
        top = _all_reduce(lse.clone(), dist.ReduceOp.MAX, group)
        total = top + _all_reduce((lse - top).exp(), dist.ReduceOp.SUM, group).log()
        share = (lse - total).exp()  # this rank's columns' probability mass
        # H = sum_r share_r (H_r + lse - lse_r): each rank's part of -sum p log p
        red = _all_reduce(torch.stack([tgt, share * (ent + total - lse)]), dist.ReduceOp.SUM, group)
        lse, tgt, ent = total, red[0], red[1]
    ctx.entropy_grad = with_entropy and entropy_grad
    if not ctx.entropy_grad:
        ctx.mark_non_differentiable(ent)
    return tgt - lse, lse, ent


def _vocab_slice(target, vocab_start: int, v_local: int, vocab_size: int, dev):
    pad = None
    if vocab_start + v_local > vocab_size:
        pad = torch.arange(vocab_start, vocab_start + v_local, device=dev) >= vocab_size
    in_range = (target >= vocab_start) & (target < vocab_start + v_local)
    return pad, in_range, (target - vocab_start).clamp(0, v_local - 1)


class _ChunkedLogProbs(torch.autograd.Function):
    """From logits [N, V_local] (kept for backward, in their dtype)."""

    @staticmethod
    def forward(ctx, logits, target, temperature: float, chunk: int, vocab_start: int, vocab_size: int,
                group, with_entropy: bool, entropy_grad: bool):
        n, v_local = logits.shape
        pad, in_range, idx = _vocab_slice(target, vocab_start, v_local, vocab_size, logits.device)
        lse, tgt, ent = (torch.zeros(n, device=logits.device) for _ in range(3))
        for i in range(0, n, chunk):
            sl = slice(i, i + chunk)
            lse[sl], tgt[sl], e = _chunk_stats(_scaled(logits[sl], temperature, pad), idx[sl], pad, with_entropy)
            if e is not None:
                ent[sl] = e
        logp, lse, ent = _outputs(ctx, lse, tgt, ent, in_range, group, with_entropy, entropy_grad)
        ctx.save_for_backward(logits, lse, ent, idx, in_range)
        ctx.pad, ctx.temperature, ctx.chunk = pad, temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, lse, ent, idx, in_range = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g_logp = torch.zeros(logits.shape[0], device=logits.device) if g_logp is None else g_logp.float()
        g_ent = g_ent if ctx.entropy_grad else None
        for i in range(0, logits.shape[0], ctx.chunk):
            sl = slice(i, i + ctx.chunk)
            grad[sl] = _chunk_grad(_scaled(logits[sl], ctx.temperature, ctx.pad), lse[sl], ent[sl], g_logp[sl],
                                   None if g_ent is None else g_ent[sl], idx[sl], in_range[sl], ctx.pad,
                                   ctx.temperature)
        return grad, None, None, None, None, None, None, None, None


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """From the last hidden states [N, H] and the output layer's weight [V, H]: each chunk's
    logits are made, used and dropped, in forward and again in backward, so no [N, V] tensor
    exists at any time (one extra chunk matmul in backward pays for it)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, temperature: float, chunk: int, with_entropy: bool, entropy_grad: bool):
        n = hidden.shape[0]
        pad, in_range, idx = _vocab_slice(target, 0, weight.shape[0], weight.shape[0], hidden.device)
        lse, tgt, ent = (torch.zeros(n, device=hidden.device) for _ in range(3))
        for i in range(0, n, chunk):
            sl = slice(i, i + chunk)
            z = _scaled(hidden[sl] @ weight.t(), temperature, None)
            lse[sl], tgt[sl], e = _chunk_stats(z, idx[sl], None, with_entropy)
            if e is not None:
                ent[sl] = e
        logp, lse, ent = _outputs(ctx, lse, tgt, ent, in_range, None, with_entropy, entropy_grad)
        ctx.save_for_backward(hidden, weight, lse, ent, idx, in_range)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, lse, ent, idx, in_range = ctx.saved_tensors
        n = hidden.shape[0]
        g_logp = torch.zeros(n, device=hidden.device) if g_logp is None else g_logp.float()
        g_ent = g_ent if ctx.entropy_grad else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for i in range(0, n, ctx.chunk):
            sl = slice(i, i + ctx.chunk)
            z = _scaled(hidden[sl] @ weight.t(), ctx.temperature, None)
            g = _chunk_grad(z, lse[sl], ent[sl], g_logp[sl], None if g_ent is None else g_ent[sl], idx[sl],
                            in_range[sl], None, ctx.temperature).to(hidden.dtype)
            if need_h:
                grad_h[sl] = g @ weight
            if need_w:  # summed over chunks in fp32, one rounding to the weight's dtype at the end
                if g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), hidden[sl])
                else:  # the chunk's product in the low precision, added without an fp32 copy of it
                    grad_w.add_(g.t() @ hidden[sl])
            del z, g
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None)


def position_log_probs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                       with_entropy: bool = False, entropy_grad: bool = True,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS, vocab_start: int = 0,
                       vocab_size: int | None = None, group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V_local] and target ids [...] at the same positions -> (log p(target) [...],
    entropy [...] or None), both float32, of ``softmax(logits / temperature)``. Differentiable in
    ``logits``; the entropy only when ``entropy_grad`` (else a metric, no graph). ``group``,
    ``vocab_start``, ``vocab_size``: vocab-parallel logits (see the module docstring)."""
    shape = target.shape
    v_local = logits.shape[-1]
    lp, ent = _ChunkedLogProbs.apply(logits.reshape(-1, v_local), target.reshape(-1), float(temperature),
                                     max(1, int(chunk_tokens)), vocab_start,
                                     v_local if vocab_size is None else vocab_size, group, with_entropy,
                                     entropy_grad)
    return lp.view(shape), (ent.view(shape) if with_entropy else None)


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                     with_entropy: bool = False, entropy_grad: bool = True,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``position_log_probs`` of the logits ``hidden @ weight.T`` (an output layer without bias),
    never holding them for more than ``chunk_tokens`` positions: hidden [..., H], weight [V, H],
    target [...]. Differentiable in both."""
    shape = target.shape
    lp, ent = _ChunkedLinearLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1),
                                           float(temperature), max(1, int(chunk_tokens)), with_entropy, entropy_grad)
    return lp.view(shape), (ent.view(shape) if with_entropy else None)


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = True,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, vocab_start: int = 0, vocab_size: int | None = None,
                    group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, T, V] (position t predicts token t+1) -> log p(ids[:, t] | <t) as [B, T] with 0
    at t=0, laid out like SequenceBatch, and each position's entropy the same way when
    ``with_entropy``. The last position predicts nothing; it is computed (so the logits are
    read in place, no copy without it) against an arbitrary id and dropped."""
    target = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    lp, ent = position_log_probs(logits, target, temperature, with_entropy, entropy_grad, chunk_tokens,
                                 vocab_start, vocab_size, group)
    lp = torch.nn.functional.pad(lp[:, :-1], (1, 0))
    if ent is not None:
        ent = torch.nn.functional.pad(ent[:, :-1], (1, 0))
    return lp, ent
