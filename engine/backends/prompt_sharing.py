"""Log-probs of a prompt-grouped micro-batch (engine/batching/prompt_groups.py): each distinct
prompt is computed once, with a KV cache copied to its rows, then the responses run against it.
Differentiable end to end, so a backend can use it inside its training forward."""

from __future__ import annotations

import torch

from engine.batching.prompt_groups import PromptGroups


def _cache_kwarg(model) -> str:
    import inspect

    fwd = getattr(model, "forward", model)
    return "cache" if "cache" in inspect.signature(fwd).parameters else "past_key_values"


def grouped_logits(model, groups: PromptGroups, device) -> torch.Tensor:
    """[b, R, V] logits; position j predicts response token j (the first from the prompt's last
    position). Same values as the plain forward's logits at columns prompt_len + j - 1."""
    dev = torch.device(device)
    pmask = groups.prompt_mask.to(dev)
    out = model(input_ids=groups.prompt_ids.to(dev), attention_mask=pmask,
                position_ids=groups.prompt_positions.to(dev), use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None)
    cache = cache if cache is not None else out.past_key_values
    owner = groups.owner.to(dev)
    cache.batch_select_indices(owner)  # every row gets its prompt's keys/values (a differentiable gather)
    attn = torch.cat([pmask[owner], groups.response_mask.to(dev)], dim=1)
    out2 = model(input_ids=groups.response_ids.to(dev), attention_mask=attn,
                 position_ids=groups.response_positions.to(dev), use_cache=True, **{_cache_kwarg(model): cache})
    return torch.cat([out.logits[:, -1:][owner], out2.logits[:, :-1]], dim=1)


def response_log_probs(logits: torch.Tensor, response_ids: torch.Tensor, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``grouped_logits`` [b, R, V] -> log p(response token j) as [b, R] (and the entropy of each
    position's distribution), the response-column twin of engine.algorithms.logprobs.token_log_probs."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, response_ids[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return lp, ent
