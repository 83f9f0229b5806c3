"""Log-probs of a prompt-grouped micro-batch (engine/batching/prompt_groups.py): each distinct
prompt is computed once, with a KV cache copied to its rows, then the responses run against it.
Differentiable end to end, so a backend can use it inside its training forward."""

from __future__ import annotations

import torch

from engine.batching.prompt_groups import PromptGroups
from engine.model.hf_cache import cache_kwarg, returned_cache


def rows_of(t: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``t``'s rows ``owner`` (prompts to their samples), differentiable. The backward sums each
    prompt's rows: on a CPU ``index_select``'s (``index_add``, serial); on CUDA advanced indexing's
    (an accumulating ``index_put``, sort-based and the same bits every run), where ``index_add``
    adds with atomics in an order that varies between runs: a resumed run's gradients then
    differed from the uninterrupted run's in the last bit."""
    return t[owner] if t.is_cuda else t.index_select(0, owner)


def _expand_cache(cache, owner: torch.Tensor) -> None:
    """Every row gets its prompt's keys/values (``rows_of``; on a CPU ``index_select``, whose
    backward ``index_add`` is ~1 ms a layer faster here than the accumulating ``index_put`` of
    transformers' ``batch_select_indices``)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(lc, "keys", None), torch.Tensor) for lc in layers):
        cache.batch_select_indices(owner)
        return
    for lc in layers:
        lc.keys = rows_of(lc.keys, owner)
        lc.values = rows_of(lc.values, owner)


def grouped_logits(model, groups: PromptGroups, device, head=None) -> torch.Tensor:
    """[b, R, V] logits; position j predicts response token j (the first from the prompt's last
    position). Same values as the plain forward's logits at columns prompt_len + j - 1. The
    responses' last column is not fed: it predicts nothing (``PromptGroups.fed``).

    ``head(target, rows)``: a context in which the output layer computes the log-prob and entropy
    of ``target`` itself (engine/backends/fused_head.py's ``head_log_probs`` with its settings
    bound); the result is then [b, R, 2] (log p(response token j), entropy) and no logits are made.
    The prompt pass hands its last position to each of the prompt's rows inside the output layer."""
    from contextlib import nullcontext

    dev = torch.device(device)
    pmask = groups.prompt_mask.to(dev)
    owner = groups.owner.to(dev)
    fed = groups.fed
    targets = groups.response_ids.to(dev) if head is not None else None
    with head(targets[:, :1], owner) if head is not None else nullcontext():
        out = model(input_ids=groups.prompt_ids.to(dev), attention_mask=pmask,
                    position_ids=groups.prompt_positions.to(dev), use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:] if head is not None else rows_of(out.logits[:, -1:], owner)
    if fed == 0:  # one-token responses: the prompt's last position predicts all there is
        return first
    cache = returned_cache(out)
    _expand_cache(cache, owner)
    attn = torch.cat([pmask.index_select(0, owner), groups.response_mask[:, :fed].to(dev)], dim=1)
    with head(targets[:, 1:fed + 1], None) if head is not None else nullcontext():
        out2 = model(input_ids=groups.response_ids[:, :fed].to(dev), attention_mask=attn,
                     position_ids=groups.response_positions[:, :fed].to(dev), use_cache=True,
                     **{cache_kwarg(model): cache})
    return torch.cat([first, out2.logits], dim=1)
