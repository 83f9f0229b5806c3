"""engine.fused_kernels: compiled RMSNorm and SiLU-gate kernels in the update (engine/model/fused_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config.load import load_run_config
from tests.dist_utils import run_ranks

VOCAB, PAD, EOS = 12, 0, 1


def _tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_fused_layers_give_the_modules_gradients(model_type):
    """The swapped forwards compute what the modules compute, forward and backward, to float
    tolerance; every RMSNorm (2 per layer + the final one) and every MLP is swapped."""
    from engine.model.fused_kernels import use_fused_kernels

    eager, fused = _tiny(model_type), _tiny(model_type)
    counts = use_fused_kernels(fused)
    assert counts == {"rms_norm": 5, "silu_gate": 2}
    assert use_fused_kernels(fused) == {"rms_norm": 0, "silu_gate": 0}  # idempotent
    ids = torch.randint(2, VOCAB, (3, 7))
    grads = []
    for m in (eager, fused):
        logits = m(input_ids=ids).logits
        (logits.logsumexp(-1).sum() - logits[..., 3].sum()).backward()
        grads.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    for n, g in grads[0][1].items():
        assert torch.allclose(g, grads[1][1][n], atol=1e-5, rtol=1e-4), n


def test_gelu_mlp_and_other_norms_keep_their_forward():
    """Only layers whose formula the kernels implement are swapped: an MLP with another
    activation keeps its own forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.fused_kernels import use_fused_kernels

    m = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, hidden_act="gelu"))
    assert use_fused_kernels(m) == {"rms_norm": 3, "silu_gate": 0}
    assert "forward" not in vars(m.model.layers[0].mlp)


def test_no_grad_forwards_run_the_modules_own_code(monkeypatch):
    """Generation and old/reference log-probs (no_grad) do not call the kernels, so the
    token-by-token shapes of decoding compile nothing; a forward that records a graph does."""
    from engine.model import fused_kernels

    calls = []

    def spy(fn):
        def kernel(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return kernel

    monkeypatch.setattr(fused_kernels, "_COMPILED", {"rms_norm": spy(fused_kernels._rms_norm),
                                                     "silu_gate": spy(fused_kernels._silu_gate)})
    m = _tiny("llama")
    fused_kernels.use_fused_kernels(m)
    ids = torch.randint(2, VOCAB, (2, 5))
    with torch.no_grad():
        m(input_ids=ids)
    assert calls == []
    m(input_ids=ids)
    assert calls.count("_rms_norm") == 5 and calls.count("_silu_gate") == 2


def test_fused_kernels_train_like_eager_on_two_ranks():
    """engine.fused_kernels=true on two FSDP2 ranks (the kernels see each block's gathered
    weights): two update steps, prompt sharing on, give the eager engine's losses and weights
    to float tolerance."""
    results = run_ranks(_fused_vs_eager, 2)
    for r in results:
        for (eager_loss, eager_w), (fused_loss, fused_w) in zip(r["eager"], r["fused"]):
            assert abs(eager_loss - fused_loss) < 1e-5, (eager_loss, fused_loss)
            assert torch.allclose(eager_w, fused_w, atol=1e-5)
        assert r["counts"]["rms_norm"] > 0 and r["counts"]["silu_gate"] > 0


def _fused_vs_eager(rank, world):
    from engine.backends.fsdp import FSDPEngine
    from tests.test_fsdp_engine import grpo_steps

    out = {}
    for name, extra in (("eager", []), ("fused", ["engine.fused_kernels=true"])):
        torch.manual_seed(0)
        cfg = load_run_config(["engine.micro_batch_size=16", "optim.lr=1e-2", *extra]).config
        eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
        eng.build()
        out[name] = grpo_steps(cfg, eng, world)
        if extra:
            out["counts"] = eng.fused_kernels
    return out


def test_a_machine_without_a_compiler_gets_a_clear_error(monkeypatch):
    """engine.fused_kernels (and engine.compile) on a CPU need a C++ compiler for inductor:
    without one the run is refused before it starts, naming the missing compiler and the fix."""
    from engine.device import check_device_config
    from engine.errors import ConfigError

    monkeypatch.setenv("CXX", "no-such-compiler-x")
    cfg = load_run_config(["engine.fused_kernels=true", "trainer.device=cpu"]).config
    with pytest.raises(ConfigError, match="no-such-compiler-x.*engine.fused_kernels=false"):
        check_device_config(cfg)
    check_device_config(load_run_config(["trainer.device=cpu"]).config)  # nothing asked: nothing checked
