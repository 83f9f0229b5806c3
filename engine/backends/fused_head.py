"""``engine.fused_lm_head``: the output layer computes the log-probs itself, inside the model's
forward, so the update never holds the [tokens, vocab] logits (nor, in backward, their gradient).

The model's forward stays the model's: only its output layer's ``forward`` is swapped, for one
call, by ``linear_log_probs`` (engine/algorithms/logprobs.py) of the hidden states it receives
against the token each position predicts. It returns [B, T, 2] (log-prob, entropy) where the
logits were, so the CausalLM output carries them out and the loss reads them from there. Doing
it inside the forward is what makes it right under FSDP2: the output layer's weight is gathered
there (the root unit's pre-forward), autograd keeps it the way a Linear would, and the loss
depends on the root's output, so FSDP2's pre-backward gathers it again for backward.

Only causal LMs whose forward does nothing to the logits after the output layer qualify (Llama,
Qwen2/3, Mistral: a bias-free Linear, no soft-capping or scaling); others are refused by name
at build time. Liger-kernel's fused linear cross-entropy does the same on GPUs in Triton; this
is plain torch, on every device.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.algorithms.logprobs import linear_log_probs
from engine.backends.prompt_sharing import rows_of

CAUSAL_LM_CLASSES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


def _causal_lm(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return base


def unfusable_reason(model) -> str:
    """'' when ``model``'s output layer can compute log-probs in place, else why not."""
    lm = _causal_lm(model)
    names = {c.__name__ for c in type(lm).__mro__}
    if not names & CAUSAL_LM_CLASSES:
        return (f"{type(lm).__name__} is not one of the causal LMs whose forward leaves the logits as the output "
                f"layer makes them ({', '.join(sorted(CAUSAL_LM_CLASSES))})")
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return f"its output layer is a {type(head).__name__}{' with a bias' if getattr(head, 'bias', None) is not None else ''}, not a bias-free Linear (a LoRA adapter on lm_head?)"
    return ""


@contextmanager
def head_log_probs(model, target: torch.Tensor, temperature: float, chunk_tokens: int, entropy_grad: bool,
                   with_entropy: bool = True, rows: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None):
    """Within the block, ``model(...).logits`` is [B, T, 2]: log p(target[:, t]) and the entropy
    at each position (``target`` [B, T] on the model's device; without ``with_entropy``, zeros
    where the entropy would be, not computed). One forward per block. ``rows`` [B]: the output
    layer's input row each target row reads (a prompt-grouped forward's prompts to their samples,
    engine/backends/prompt_sharing.py), so the forward's batch may be smaller than ``target``'s.
    ``positions``: the flat indices (into B x T, on the model's device) of the only positions to
    compute, zeros elsewhere: the output layer's work, and what it keeps for backward, is then
    theirs alone (``response_positions``)."""
    head = _causal_lm(model).get_output_embeddings()
    had_own = "forward" in head.__dict__
    own = head.__dict__.get("forward")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if rows is not None:
            hidden = rows_of(hidden, rows)
        if positions is None:
            lp, ent = linear_log_probs(hidden, head.weight, target, temperature, with_entropy=with_entropy,
                                       entropy_grad=entropy_grad, chunk_tokens=chunk_tokens)
            return torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], dim=-1)
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        lp, ent = linear_log_probs(flat, head.weight, target.reshape(-1).index_select(0, positions), temperature,
                                   with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_tokens=chunk_tokens)
        both = torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], dim=-1)
        out = both.new_zeros(target.numel(), 2).index_copy(0, positions, both)
        return out.view(*target.shape, 2)

    head.forward = forward
    try:
        yield
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


def response_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """The flat indices of the positions [B, T] that predict a response token (position t
    predicts token t + 1): all the loss, the old and reference log-probs and the entropy read.
    At least one, so a micro-batch without any (a zero-weight twin) still goes through the output
    layer and its weight gets a (zero) gradient like every other rank's. On the host, from the
    batch's own mask: no device sync."""
    need = torch.zeros(response_mask.shape, dtype=torch.bool)
    need[:, :-1] = response_mask[:, 1:].cpu() > 0
    idx = need.flatten().nonzero().squeeze(1)
    return idx if idx.numel() else torch.zeros(1, dtype=torch.long)
