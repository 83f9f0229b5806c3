"""Real-device checks (marker `gpu`; CI deselects them with -m "not gpu", and they skip
without CUDA). bench/gpu_check.sh runs them on a lent GPU. The CPU tests of the same paths use
stand-ins where the real library needs CUDA (Transformer Engine); these use the real things:

- CUDA param and optimizer offload: device memory really drops and comes back bit-exact;
- Transformer Engine FP8 weight workspaces: real te.Linear layers, cleared by offload
  (bench/gpu_check_memory.sh part 2, with figures);
- megatron-core with the TE layer spec, bf16 and FP8 (bench/gpu_check_megatron.sh);
- vLLM sleep/wake around an update (bench/gpu_check_vllm.sh);
- activation offload: peak memory and step time with and without, bit-identical gradients
  (bench/gpu_check_activation_offload.sh).
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
                                          ("bench/gpu_check_activation_offload.sh", 150)])
def test_gpu_check_script(script, limit):
    r = subprocess.run(["bash", str(ROOT / script)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "GPU_CHECK_TIMEOUT": str(limit)}, timeout=limit + 30)
    print(r.stdout[-6000:])
    if r.returncode == 2:
        pytest.skip("missing: " + "; ".join(ln.strip() for ln in r.stdout.splitlines() if "MISSING" in ln))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
