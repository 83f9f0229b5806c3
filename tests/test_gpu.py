"""Real-device checks (marker `gpu`; CI deselects them with -m "not gpu", and they skip
without CUDA). bench/gpu_check.sh runs them on a lent GPU. The CPU tests of the same paths use
stand-ins where the real library needs CUDA (Transformer Engine); these use the real things:

- CUDA param and optimizer offload: device memory really drops and comes back bit-exact;
- Transformer Engine FP8 weight workspaces: real te.Linear layers, cleared by offload
  (bench/gpu_check_memory.sh part 2, with figures);
- megatron-core with the TE layer spec, bf16 and FP8 (bench/gpu_check_megatron.sh);
- vLLM sleep/wake around an update (bench/gpu_check_vllm.sh);
- activation offload: peak memory and step time with and without, bit-identical gradients
  (bench/gpu_check_activation_offload.sh);
- the commands on CUDA: `rl train`, `rl resume` bit-exact against a straight run (metrics and every
  DCP entry), PPO, LoRA, `--engine megatron` fp32/bf16, trainer.mode=one_step_off
  (bench/gpu_check_train.sh).
The three scripts print figures and exit 0 (passed), 1 (a check failed) or 2 (a dependency is
missing, printed as MISSING)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _alloc() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_cuda_param_and_optimizer_offload_frees_and_restores_exactly():
    from engine.memory.offload import (offload_optimizer_state, offload_params, onload_optimizer_state,
                                       onload_params)

    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device=dev)).sum().backward()
    opt.step()
    before = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    full = _alloc()
    rep = offload_params(model)
    ropt = offload_optimizer_state(opt)
    assert rep.param_bytes == param_bytes and ropt.optimizer_bytes >= 2 * param_bytes
    assert full - _alloc() >= param_bytes + ropt.optimizer_bytes  # grads released too
    onload_params(model, dev)
    onload_optimizer_state(opt)
    assert all(torch.equal(before[k], v.cpu()) for k, v in model.state_dict().items())
    opt.step()  # the optimizer still works on the device after the round trip


@pytest.mark.parametrize("script,limit", [("bench/gpu_check_memory.sh", 200), ("bench/gpu_check_megatron.sh", 220),
                                          ("bench/gpu_check_vllm.sh", 200),
                                          ("bench/gpu_check_activation_offload.sh", 150),
                                          ("bench/gpu_check_train.sh", 300), ("bench/gpu_check_bench.sh", 300)])
def test_gpu_check_script(script, limit):
    r = subprocess.run(["bash", str(ROOT / script)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "GPU_CHECK_TIMEOUT": str(limit)}, timeout=limit + 30)
    print(r.stdout[-6000:])
    if r.returncode == 2:
        pytest.skip("missing: " + "; ".join(ln.strip() for ln in r.stdout.splitlines() if "MISSING" in ln))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_static_kv_cache_decode_on_cuda_matches_the_model_forward():
    """The torch sampler's static-cache decode (engine/rollout/static_decode.py) on CUDA: same
    greedy tokens and log-probs within 1e-3 of the model's own forward in fp32; runs in bf16."""
    import dataclasses

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine.config.schema import RolloutConfig
    from engine.rollout.static_decode import StaticDecode
    from engine.rollout.torch_sampler import TorchSampler

    dev = torch.device("cuda", 0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    cfg._attn_implementation = "sdpa"
    prompts = [[int(t) for t in torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 9, 17, 3)]
    rc = dataclasses.replace(RolloutConfig(), max_new_tokens=24)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).to(dev, dtype).eval()
        out = [TorchSampler(rc, 0, 1, dev, static_cache=s).generate(model, prompts, 2, torch.Generator().manual_seed(0),
                                                                     greedy=True) for s in (True, False)]
        if dtype == torch.float32:  # bf16 may pick another SDPA kernel per path: tokens can differ there
            assert torch.equal(out[0].input_ids, out[1].input_ids)
            assert torch.allclose(out[0].rollout_log_probs, out[1].rollout_log_probs, atol=1e-3)
        assert out[0].response_lengths.max() <= 24 and torch.isfinite(out[0].rollout_log_probs).all(), dtype
        with torch.no_grad():
            o = model(input_ids=torch.tensor([[5, 6, 7]], device=dev), use_cache=True)
        cache = getattr(o, "cache", None) or o.past_key_values
        assert StaticDecode.start(model, cache, torch.ones(1, 3, dtype=torch.long, device=dev), 4) is not None
