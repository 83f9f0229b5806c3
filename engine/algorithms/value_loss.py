"""PPO's critic, the engine-independent part: where a value belongs, and its clipped loss.
Both critics (FSDP2: engine/backends/fsdp/critic.py; Megatron: engine/backends/megatron/critic.py)
use these.

Values follow the log-prob convention of the batch: ``values[:, t]`` is V(tokens < t), the
value of the state in which token t was sampled, read from the hidden state at t - 1.

Loss (verl/OpenRLHF): 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), averaged
over the response tokens of the global mini-batch, where R are the GAE returns and V_old the
values computed before the update.
"""

from __future__ import annotations

import torch


def values_per_token(head_out: torch.Tensor) -> torch.Tensor:
    """[B, T] value-head outputs (position t read tokens <= t) -> [B, T] V(tokens < t): shifted
    right by one; position 0 (no prefix) gets 0."""
    return torch.nn.functional.pad(head_out[:, :-1], (1, 0))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, n_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss summed over this micro-batch's tokens / ``n_tokens`` (the global
    count), and the share of tokens where the clipped term was the larger."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    a, b = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(a, b) * mask).sum() / max(n_tokens, 1.0)
    return loss, ((b > a).float() * mask).sum() / max(n_tokens, 1.0)
