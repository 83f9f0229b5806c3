#!/usr/bin/env bash
# GPU check for activation offload (issue 22): peak memory and step time of one training
# forward/backward of a Llama-style model at a long sequence, without and with
# engine/memory/activation_offload.py (side-stream copies to pinned host buffers, prefetch one
# layer ahead), with and without gradient checkpointing; gradients must match (bit for bit
# where the kernels are deterministic; otherwise within the plain path's own run-to-run noise).
#
#     bash bench/gpu_check_activation_offload.sh    # GPU_CHECK_TIMEOUT=150 from bench/gpu_check.sh
#
# Exit 0: every check passed; 1: a check failed; 2: no CUDA device (printed as MISSING).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout "${GPU_CHECK_TIMEOUT:-300}" python3 - <<'PY'
import copy
import sys
import time

import torch

if not torch.cuda.is_available():
    print("  MISSING: a CUDA device (and a CUDA build of torch). Nothing to check here.")
    sys.exit(2)
from engine.config.schema import ModelConfig
from engine.memory.activation_offload import ActivationOffloader, use_reentrant_checkpointing
from engine.model.build import build_hf_model

GiB = float(1 << 30)
dev = torch.device("cuda", 0)
failed = []
B, T, V = 4, 4096, 32000
cfg = ModelConfig(hidden_size=1024, intermediate_size=2816, num_layers=12, num_attention_heads=16,
                  num_key_value_heads=4, max_position_embeddings=T, dtype="bfloat16")
base = build_hf_model(cfg, "", V, 0, 0, 1).to(dev, torch.bfloat16).train()
ids = torch.randint(3, V, (B, T), device=dev)


def run(model, offload, reps=3):
    off = ActivationOffloader(model, ["model.layers.*"], 64 << 30, dev).attach() if offload else None
    times, peak = [], 0
    for _ in range(reps):
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1).mean()
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated()
        st = off.end_micro_batch() if off else None
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    if off:
        off.detach()
    return sorted(times)[len(times) // 2], peak, grads, st


for gc in (False, True):
    plain, offl = copy.deepcopy(base), copy.deepcopy(base)
    if gc:
        use_reentrant_checkpointing(plain)
        use_reentrant_checkpointing(offl)
    t0, p0, g0, _ = run(plain, False)
    t1, p1, g1, st = run(offl, True)
    _, _, g0b, _ = run(plain, False, reps=1)   # run-to-run noise of CUDA kernels (atomics), if any
    noise = max(float((g0[k] - g0b[k]).abs().max()) for k in g0)
    diff = max(float((g0[k] - g1[k]).abs().max()) for k in g0)
    same = diff <= noise
    print(f"  gradients: max |offload - plain| {diff:.3e}, plain run-to-run {noise:.3e}")
    print(f"== seq {T} x {B}, 12 layers, bf16, gradient checkpointing {gc}")
    print(f"  peak allocated: {p0 / GiB:.2f} GiB -> {p1 / GiB:.2f} GiB with offload ({p1 / p0:.2f}x); "
          f"step {t0 * 1e3:.0f} ms -> {t1 * 1e3:.0f} ms ({t1 / t0:.2f}x)")
    print(f"  offloaded {st.host_bytes / GiB:.2f} GiB in {st.tensors_offloaded} tensors; prefetched "
          f"{st.prefetched}, on demand {st.fetched_on_demand}, kept on device {st.kept_bytes / GiB:.2f} GiB")
    for ok, what in ((same, "gradients equal (within the plain path's own run-to-run noise, 0 when deterministic)"), (p1 < p0, "offload lowers the peak"),
                     (st.prefetched > 0, "backward prefetch used")):
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            failed.append(what)
    del plain, offl
    torch.cuda.empty_cache()
sys.exit(1 if failed else 0)
PY
