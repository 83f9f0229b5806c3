"""engine/algorithms/logprobs.py against the formulas: log p(y) = z_y - logsumexp(z) and
H = -sum p log p with z = logits / T, their gradients against float64 autograd of those
formulas, whatever the chunk size; what the function keeps for backward (the logits in their own
dtype, nothing [tokens, vocab] in fp32); and the vocab-parallel path on two real gloo ranks,
each holding half of a padded vocabulary, against the formula over the whole one."""

from __future__ import annotations

import pytest
import torch

from engine.algorithms.logprobs import linear_log_probs, position_log_probs, token_log_probs
from tests.dist_utils import run_ranks

B, T, V = 3, 9, 37


def _formula(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """float64 log p(ids[:, t] | <t) and entropy at column t (0 at t=0), from log_softmax."""
    logp_all = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)
    lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.nn.functional.pad(lp, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


def _case(seed: int = 0, scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale
    ids = torch.randint(0, V, (B, T), generator=g)
    w_lp, w_ent = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    return logits, ids, w_lp, w_ent


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_values_and_gradients_follow_the_formulas(temperature, chunk):
    """Any chunking gives the formula's log-probs and entropies, and the gradient of
    sum(w_lp * lp + w_ent * H) that float64 autograd of the formula gives."""
    logits, ids, w_lp, w_ent = _case()
    ref_lp, ref_ent = _formula(logits, ids, temperature)
    x = logits.float().requires_grad_()
    lp, ent = token_log_probs(x, ids, temperature, with_entropy=True, chunk_tokens=chunk)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (B, T)
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)

    (lp.double() * w_lp + ent.double() * w_ent).sum().backward()
    x64 = logits.clone().requires_grad_()
    r_lp, r_ent = _formula(x64, ids, temperature)
    (r_lp * w_lp + r_ent * w_ent).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=1e-5)
    assert (x.grad[:, -1] == 0).all()  # the last position predicts nothing


def test_a_metric_entropy_carries_no_gradient():
    """entropy_grad=False: the entropy is a number for the step table; the gradient is the
    log-probs' alone (an entropy in the loss by mistake would change the update)."""
    logits, ids, w_lp, _ = _case(1)
    x = logits.float().requires_grad_()
    lp, ent = token_log_probs(x, ids, 1.0, with_entropy=True, entropy_grad=False, chunk_tokens=4)
    assert not ent.requires_grad and lp.requires_grad
    (lp.double() * w_lp).sum().backward()
    x64 = logits.clone().requires_grad_()
    (_formula(x64, ids, 1.0)[0] * w_lp).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=1e-5)


def test_bf16_logits_keep_their_dtype_and_are_all_that_is_saved():
    """What autograd keeps for backward is the bf16 logits' own storage plus a few numbers per
    position: no fp32 [tokens, vocab] copy, log-softmax or softmax (the plain path keeps
    two fp32 ones, 8x the bytes of bf16 logits). The gradient comes back in bf16."""
    logits, ids, w_lp, w_ent = _case(2, scale=2.0)
    x = logits.to(torch.bfloat16).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = token_log_probs(x, ids, 1.0, with_entropy=True, chunk_tokens=4)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    assert x.untyped_storage().data_ptr() in storages
    others = sum(n for p, n in storages.items() if p != x.untyped_storage().data_ptr())
    assert others <= 32 * B * T, f"{others} B saved besides the logits"
    (lp * w_lp.float() + ent * w_ent.float()).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    x64 = x.detach().double().requires_grad_()
    r_lp, r_ent = _formula(x64, ids, 1.0)
    (r_lp * w_lp + r_ent * w_ent).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-2, atol=1e-2)


def test_same_position_targets_for_prompt_grouped_columns():
    """position_log_probs: the target at the same position (the prompt-grouped update's
    response columns), so column j of [b, R, V] is log p(ids[:, j])."""
    logits, ids, _, _ = _case(3)
    lp, ent = position_log_probs(logits.float(), ids, 0.8, with_entropy=True, chunk_tokens=2)
    logp_all = torch.log_softmax(logits / 0.8, dim=-1)
    torch.testing.assert_close(lp.double(), logp_all.gather(-1, ids[..., None]).squeeze(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(logp_all.exp() * logp_all).sum(-1), rtol=0, atol=1e-5)


def _vocab_half(rank: int, world: int, logits, ids, w_lp, w_ent, vocab: int, temperature: float):
    import torch.distributed as dist

    v_local = logits.shape[-1] // world
    x = logits[..., rank * v_local:(rank + 1) * v_local].float().clone().requires_grad_()
    lp, ent = token_log_probs(x, ids, temperature, with_entropy=True, chunk_tokens=5,
                              vocab_start=rank * v_local, vocab_size=vocab, group=dist.group.WORLD)
    (lp.double() * w_lp + ent.double() * w_ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def test_vocab_parallel_slices_on_two_ranks_give_the_whole_vocabulary_formula():
    """Megatron's tensor parallelism: two gloo ranks each hold half the columns of a vocabulary
    padded from V to V + 1 (the pad column has probability 0 however large its logit). Both
    get the formula's log-probs and entropies over the V real tokens, and their gradient slices
    put together are the formula's gradient (0 on the pad column)."""
    logits, ids, w_lp, w_ent = _case(4)
    padded = torch.cat([logits, torch.full((B, T, 1), 50.0, dtype=torch.float64)], dim=-1)  # V + 1 = 38
    ref_lp, ref_ent = _formula(logits, ids, 0.7)
    x64 = logits.clone().requires_grad_()
    r_lp, r_ent = _formula(x64, ids, 0.7)
    (r_lp * w_lp + r_ent * w_ent).sum().backward()
    results = run_ranks(_vocab_half, 2, padded, ids, w_lp, w_ent, V, 0.7)
    for lp, ent, _ in results:
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    grad = torch.cat([g for _, _, g in results], dim=-1)
    assert (grad[..., V:] == 0).all()
    torch.testing.assert_close(grad[..., :V].double(), x64.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [3, 1000])
def test_output_layer_fused_pass_follows_the_formulas(chunk):
    """linear_log_probs(h, W): the formula's log-probs and entropies of h @ W.T / T, and float64
    autograd's gradients in both h and W, while what it keeps for backward is h and W themselves
    (no [tokens, vocab] tensor)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(V, 16, generator=g, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    w_lp, w_ent = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    saved: list = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp, ent = linear_log_probs(hf, wf, ids, 0.8, with_entropy=True, chunk_tokens=chunk)
    assert max(t.numel() for t in saved) == max(hf.numel(), wf.numel())  # nothing of B*T*V elements
    (lp.double() * w_lp + ent.double() * w_ent).sum().backward()

    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp_all = torch.log_softmax(h64 @ w64.t() / 0.8, dim=-1)
    r_lp = logp_all.gather(-1, ids[..., None]).squeeze(-1)
    r_ent = -(logp_all.exp() * logp_all).sum(-1)
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=0, atol=1e-5)
    (r_lp * w_lp + r_ent * w_ent).sum().backward()
    torch.testing.assert_close(hf.grad.double(), h64.grad, rtol=0, atol=1e-4)
    torch.testing.assert_close(wf.grad.double(), w64.grad, rtol=0, atol=1e-4)
