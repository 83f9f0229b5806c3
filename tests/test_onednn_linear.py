"""engine.cpu_matmul: linear layers through oneDNN's fp32 GEMM on a CPU (engine/model/onednn_linear.py).

What it protects: the oneDNN path computes what ``F.linear`` computes (forward, input, weight
and bias gradients) to fp32 rounding, for every input layout the models feed it; it is the path
the engine and the decode step actually take by default on a CPU (the op shows up in the
profiler); ``aten`` turns it off; the update and the rollout give the same numbers as the aten
path within float tolerance; anything it does not support falls back to ``F.linear`` exactly."""

from __future__ import annotations

import dataclasses

import os

import pytest
import torch
import torch.nn.functional as F

from engine.model.onednn_linear import onednn_available, onednn_linear, resolve, use_onednn_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")

VOCAB, PAD, EOS = 40, 0, 1


def _grads(fn, x, weight, bias):
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    bias = None if bias is None else bias.detach().clone().requires_grad_()
    y = fn(x, weight, bias)
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    y.backward(g)
    return y.detach(), x.grad, weight.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("shape", [(7, 32), (3, 5, 32), (2, 3, 4, 32), (1, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [16, 48])   # both weight-gradient orientations
def test_forward_and_every_gradient_match_f_linear(shape, bias, out_features):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    w = torch.randn(out_features, shape[-1])
    b = torch.randn(out_features) if bias else None
    ours, ref = _grads(onednn_linear, x, w, b), _grads(F.linear, x, w, b)
    for name, a, r in zip(("output", "input grad", "weight grad", "bias grad"), ours, ref):
        if r is None:
            assert a is None
            continue
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-5), (name, (a - r).abs().max())


def test_non_contiguous_inputs_and_frozen_weights():
    """A transposed view as input (attention outputs are views), and a frozen weight (LoRA's
    base layer): only the input's gradient is computed, and it is right."""
    torch.manual_seed(1)
    x = torch.randn(32, 6).t().requires_grad_()       # [6, 32], non-contiguous
    w = torch.randn(24, 32)                           # requires no grad
    y = onednn_linear(x, w)
    y.sum().backward()
    assert torch.allclose(y, F.linear(x, w), atol=1e-5)
    assert torch.allclose(x.grad, torch.ones(6, 24) @ w, atol=1e-5)
    assert w.grad is None


def test_unsupported_dtypes_and_no_grad_paths():
    """float64 and bf16 (anything not fp32 on a CPU) are F.linear itself, bit for bit; under
    no_grad the oneDNN product needs no graph and equals the graph path's output."""
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(onednn_linear(x, w), F.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(onednn_linear(xb, wb), F.linear(xb, wb))
    xf, wf = x.float(), w.float().requires_grad_()
    with torch.no_grad():
        a = onednn_linear(xf, wf)
    assert not a.requires_grad
    assert torch.equal(a, onednn_linear(xf, wf).detach())


def test_results_are_deterministic():
    """The same inputs give the same bits on every call (bit-exact resume needs it)."""
    torch.manual_seed(2)
    x, w = torch.randn(300, 64), torch.randn(96, 64, requires_grad=True)
    runs = [_grads(onednn_linear, x, w, None) for _ in range(3)]
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[:3], runs[0][:3]))


def test_resolve_picks_onednn_on_amd_x86_cpus_only(monkeypatch):
    """auto = oneDNN where MKL runs its AVX2 code although the CPU has AVX-512 (AMD, Hygon);
    torch's own GEMM on Intel (MKL's AVX-512 code measured faster there), other CPUs, unknown
    vendors and any non-CPU device; an explicit choice is honoured everywhere."""
    import platform

    from engine.model import onednn_linear

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    cpu = torch.device("cpu")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for vendor, auto in [("AuthenticAMD", "onednn"), ("HygonGenuine", "onednn"), ("GenuineIntel", "aten"), ("", "aten")]:
        monkeypatch.setattr(onednn_linear, "cpu_vendor", lambda v=vendor: v)
        assert resolve("auto", cpu) == auto, vendor
        assert resolve("onednn", cpu) == "onednn" and resolve("aten", cpu) == "aten"
        assert resolve("auto", torch.device("meta")) == "aten"   # any non-CPU device keeps its kernels
    with pytest.raises(ValueError, match="cpu_matmul"):
        resolve("mkl", cpu)
    monkeypatch.setattr(onednn_linear, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")   # other CPUs keep torch's BLAS by default
    assert resolve("auto", cpu) == "aten" and resolve("onednn", cpu) == "onednn"


def test_this_machines_vendor_is_read():
    import platform

    from engine.model.onednn_linear import cpu_vendor

    if platform.machine().lower() not in ("x86_64", "amd64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("an x86 Linux fact")
    assert cpu_vendor() and cpu_vendor().isalnum(), cpu_vendor()   # e.g. GenuineIntel, AuthenticAMD


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_swaps_plain_linears_only_and_once():
    """Every nn.Linear of a model is swapped (7 per layer + the head), idempotently; a LoRA
    wrapper keeps its own forward while its base and adapter linears get oneDNN, and the
    model still computes what it computed."""
    from peft import LoraConfig, get_peft_model

    model = _tiny_llama()
    ids = torch.randint(2, VOCAB, (2, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert use_onednn_linears(model) == 2 * 7 + 1
    assert use_onednn_linears(model) == 0
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-5)

    lora = get_peft_model(_tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    n = use_onednn_linears(lora)
    assert n == 2 * 7 + 1 + 2 * 2 * 2       # + lora_A and lora_B of q and v in both layers
    wrapper = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert "forward" not in vars(wrapper) and "forward" in vars(wrapper.base_layer)


def _profiled_ops(fn) -> set[str]:
    from torch.profiler import profile

    with profile() as p:
        fn()
    return {e.key for e in p.key_averages()}


def _engine(cpu_matmul: str):
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config

    cfg = load_run_config(["model.hidden_size=64", "model.intermediate_size=96", "model.num_layers=2",
                           "model.num_attention_heads=4", "model.num_key_value_heads=2",
                           "rollout.max_new_tokens=8", "rollout.temperature=0.8",
                           f"engine.cpu_matmul={cpu_matmul}"]).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    return cfg, eng


def _grpo_step(rank, world, cpu_matmul: str):
    from engine.algorithms.advantages import grpo_advantages, token_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.rollout.torch_sampler import TorchSampler

    from tests.dist_utils import full_tensor

    cfg, eng = _engine(cpu_matmul)
    before = {n: full_tensor(p).detach().clone() for n, p in eng.model.named_parameters()}
    sampler = TorchSampler(cfg.rollout, PAD, EOS, eng.device)
    with eng.generation_model() as m:
        batch = sampler.generate(m, [[3, 4, 5], [6, 7], [8, 9, 10, 11]], 4, torch.Generator().manual_seed(0))
    batch.advantages = token_advantages(grpo_advantages(torch.linspace(0, 1, len(batch)), 4), batch.response_mask)
    ops = _profiled_ops(lambda: eng.train_step(batch, PolicyLoss(cfg.algorithm, 1)))
    recomputed, _ = eng.compute_log_probs(batch)
    after = {n: full_tensor(p).detach().clone() for n, p in eng.model.named_parameters()}
    return {"swapped": eng.onednn_linears, "ops": ops, "ids": batch.input_ids, "logps": batch.rollout_log_probs,
            "recomputed": recomputed, "before": before, "after": after}


def test_the_engine_trains_through_onednn_like_aten():
    """``engine.cpu_matmul=onednn`` (auto's choice on AMD CPUs) swaps every linear of the policy,
    the update really runs oneDNN's op, and one GRPO step (rollout, update, recompute) gives what torch's own GEMM
    gives: the same sampled tokens, log-probs within 1e-5, and weights after the AdamW step
    within 1e-5 of aten's (the step itself moves them by ~lr = 5e-3). ``aten`` runs no oneDNN op."""
    from tests.dist_utils import run_ranks

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    fast, = run_ranks(_grpo_step, 1, "onednn")
    slow, = run_ranks(_grpo_step, 1, "aten")
    assert fast["swapped"] == 2 * 7 + 1 and slow["swapped"] == 0
    assert "mkldnn::_linear_pointwise" in fast["ops"] and "mkldnn::_linear_pointwise" not in slow["ops"]
    assert torch.equal(fast["ids"], slow["ids"])
    assert torch.allclose(fast["logps"], slow["logps"], atol=1e-5)
    assert torch.allclose(fast["recomputed"], slow["recomputed"], atol=1e-5)
    moved = 0
    for n, w in fast["after"].items():
        assert torch.allclose(w, slow["after"][n], atol=1e-5), n
        moved += not torch.equal(w, fast["before"][n])
    assert moved == len(fast["after"])  # the step trained every tensor


def test_decode_steps_multiply_through_onednn():
    """The static decode step uses oneDNN when the model's linears do (fused q|k|v and gate|up
    on the stored [out, in] weights), and samples what the model's own forward samples."""
    from engine.config.schema import RolloutConfig
    from engine.rollout.torch_sampler import TorchSampler

    model = _tiny_llama()
    with torch.no_grad():
        head = model.lm_head.weight
        head[EOS] += 0.8 * head.std() * torch.randn(head.shape[1])
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=10)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]

    def generate(static):
        return TorchSampler(cfg, PAD, EOS, torch.device("cpu"), static_cache=static).generate(
            model, prompts, 4, torch.Generator().manual_seed(3))

    aten = generate(True)
    use_onednn_linears(model)
    ops = set()
    static = None

    def run():
        nonlocal static
        static = generate(True)

    ops = _profiled_ops(run)
    dynamic = generate(False)
    assert "mkldnn::_linear_pointwise" in ops and "aten::addmm" not in ops
    assert torch.equal(static.input_ids, dynamic.input_ids) and torch.equal(static.input_ids, aten.input_ids)
    assert torch.allclose(static.rollout_log_probs, dynamic.rollout_log_probs, atol=1e-5)
    assert torch.allclose(static.rollout_log_probs, aten.rollout_log_probs, atol=1e-5)


def test_config_key_is_checked_and_may_change_on_resume():
    from engine.checkpoint.resume_rules import ALLOWED
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    assert load_run_config([]).config.engine.cpu_matmul == "auto"
    with pytest.raises(ConfigError, match="cpu_matmul"):
        load_run_config(["engine.cpu_matmul=mkl"])
    assert "engine.cpu_matmul" in ALLOWED


def test_a_packed_weight_multiplies_like_the_dense_one():
    """pack_weight reorders a weight once for many products (a rollout's decode steps): from 5
    rows up the product is the dense weight's bit for bit, at any row count (rows leave the decode
    batch as they finish), and at 1 row (oneDNN's vector kernel) within 1e-5 relative; weights it
    cannot reorder (float64) come back unchanged."""
    from engine.model.onednn_linear import onednn_matmul, pack_weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    packed = pack_weight(w, 32)
    assert packed.is_mkldnn and packed.shape == w.shape
    for rows in (5, 17, 32, 33, 70):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(onednn_matmul(x, packed, None), onednn_matmul(x, w, None)), rows
        assert torch.equal(onednn_matmul(x, packed, b), onednn_matmul(x, w, b)), rows
    x = torch.randn(1, 64, generator=g)
    assert torch.allclose(onednn_matmul(x, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    w64 = w.double()
    assert pack_weight(w64, 32) is w64


def test_decode_weights_are_packed_once_per_rollout():
    """With oneDNN linears the static decoder multiplies by packed copies of the fused q|k|v and
    gate|up weights, the output/down projections and the LM head, made when the rollout starts and
    shared by its decode lanes."""
    from transformers import DynamicCache

    from engine.model.hf_cache import cache_kwarg, returned_cache
    from engine.rollout.static_decode import StaticDecode

    model = _tiny_llama()
    use_onednn_linears(model)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    with torch.no_grad():
        cache = returned_cache(model(input_ids=ids, use_cache=True, **{cache_kwarg(model): DynamicCache()}))
    first = StaticDecode.start(model, cache, torch.ones_like(ids), 4)
    second = StaticDecode.start(model, cache, torch.ones_like(ids), 4, like=first)
    assert first is not None and all(q[0].is_mkldnn and q[2] for q in first.qkv)
    assert all(gu[0].is_mkldnn for gu in first.gate_up)
    assert second.qkv is first.qkv and second.lm_head is first.lm_head
