"""Per-token log-probs and entropy from logits, laid out like SequenceBatch ([B, T], value
for token t at column t, 0 at t=0)."""

from __future__ import annotations

import torch


def entropy_from_log_probs(logp_all: torch.Tensor, grad: bool = True) -> torch.Tensor:
    """-sum p log p over the last dimension; ``grad=False``: a metric only (no graph kept)."""
    if not grad:
        logp_all = logp_all.detach()
    return -(logp_all.exp() * logp_all).sum(-1)


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, T, V] (position t predicts token t+1) -> log p(ids[:, t] | <t) as [B, T], and
    the entropy of each position's distribution when ``with_entropy`` (differentiable unless
    ``entropy_grad=False``: from the same log-softmax, for a metric)."""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    lp = torch.nn.functional.pad(lp, (1, 0))
    ent = None
    if with_entropy:
        ent = torch.nn.functional.pad(entropy_from_log_probs(logp_all, entropy_grad), (1, 0))
    return lp, ent
