#!/usr/bin/env bash
# GPU check for engine/memory (issue 5). One script, a few minutes on one H200; run it from the
# repository root on a machine with a CUDA device:
#
#     bash bench/gpu_check_memory.sh     # GPU_CHECK_TIMEOUT=180 here when run from bench/gpu_check.sh
#
# Part 1 (needs torch with CUDA; transformers for the estimate comparison):
#   a Llama-style model (HF transformers, fp32) on the device: one measured update step, then
#   offload/onload of params + optimizer state with engine.memory.offload. Prints what the
#   reports say moved vs what the allocator actually freed, whether host buffers are pinned,
#   the bit-exact round trip, the re-offload time against the first offload (host buffers
#   reused), and the estimator's numbers beside the tracker's measured ones.
# Part 2 (needs transformer_engine and an FP8-capable GPU, sm >= 8.9):
#   real te.Linear layers under fp8_autocast, forward/backward with is_first_microbatch=True
#   (so TE caches FP8 weight workspaces), then prints memory allocated
#     before offload | after offload WITHOUT clearing workspaces | after offload WITH clearing
#   with ratios against "before", the workspace count/bytes the report gives, and checks that
#   the next forward rebuilds them.
# Anything missing (CUDA, transformers, transformer_engine, FP8 support) is printed as
# MISSING with what to install; the exit code is 0 when every part ran and passed, 2 when a
# part was skipped for a missing dependency, 1 when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec timeout "${GPU_CHECK_TIMEOUT:-540}" python3 - <<'PY'
import json
import sys
import time

import torch

GiB = float(1 << 30)
MiB = float(1 << 20)
missing, failed = [], []


def gib(n):
    return f"{n / GiB:8.3f} GiB"


def check(ok, what):
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        failed.append(what)


def alloc():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


print("== environment")
print(f"  torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    print("  MISSING: a CUDA device (and a CUDA build of torch). Nothing to check here.")
    sys.exit(2)
dev = torch.device("cuda", 0)
cap = torch.cuda.get_device_capability(dev)
print(f"  device: {torch.cuda.get_device_name(dev)}, sm {cap[0]}.{cap[1]}, "
      f"{torch.cuda.get_device_properties(dev).total_memory / GiB:.1f} GiB")
try:
    import transformers
    print(f"  transformers {transformers.__version__}")
    have_hf = True
except ImportError:
    have_hf = False
    missing.append("transformers (pip install 'transformers>=4.51'): part 1 falls back to plain nn.Linear "
                   "layers and skips the estimate comparison")
try:
    import transformer_engine
    import transformer_engine.pytorch as te
    print(f"  transformer_engine {getattr(transformer_engine, '__version__', '?')}")
except Exception as e:  # ImportError, or a TE build that does not match this torch/CUDA
    te = None
    missing.append(f"transformer_engine ({type(e).__name__}: {e}); install on a machine with internet: "
                   "pip install --no-build-isolation 'transformer-engine[pytorch]' (it must match this torch "
                   "and CUDA); part 2 (FP8 workspaces) is skipped")

from engine.memory.fp8_workspaces import fp8_workspace_bytes
from engine.memory.offload import (_STATES, host_memory_held, offload_optimizer_state, offload_params,
                                   onload_optimizer_state, onload_params)
from engine.memory.tracker import MemoryTracker

# ---------------------------------------------------------------------------------- part 1
print("\n== part 1: param/optimizer offload on the device, tracker vs estimate")
torch.manual_seed(0)
B, T, V = 16, 512, 32000
if have_hf:
    from engine.config.schema import ModelConfig, RunConfig
    from engine.model.build import build_hf_model

    run_cfg = RunConfig()
    run_cfg.model = ModelConfig(hidden_size=1024, intermediate_size=2816, num_layers=8, num_attention_heads=16,
                                num_key_value_heads=4, max_position_embeddings=T, dtype="float32")
    run_cfg.data.train_batch_size, run_cfg.algorithm.rollout_n = 2, 8                 # 16 sequences
    run_cfg.engine.max_tokens_per_micro_batch = B * T
    model = build_hf_model(run_cfg.model, "", vocab_size=V, seed=0).to(dev)
    model.config.use_cache = False
else:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
tracker = MemoryTracker(dev, models={"policy": model}, optimizer=opt)
ids = torch.randint(3, V, (B, T), device=dev)
mask = torch.ones(B, T, dtype=torch.long, device=dev)
mask[B // 2:, T // 2:] = 0                                                          # right padding
with tracker.phase("update", step=1):
    if have_hf:
        with tracker.activations():
            out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        from engine.algorithms.logprobs import token_log_probs

        with tracker.saved_tensors("logits") as m:  # as the engine measures it (engine/backends/fsdp/engine.py)
            m.add(out.logits)
            tok, _ = token_log_probs(out.logits, ids)
        loss = -(tok * mask).sum() / mask.sum()
        del out
    else:
        with tracker.activations():
            loss = model(torch.randn(B * T, 1024, device=dev)).pow(2).mean()
    loss.backward()
    tracker.sample_state()
    opt.step()
    del loss
rec = tracker.phase_records()[-1]
print(f"  update phase: allocated {gib(rec.allocated)}  peak {gib(rec.peak_allocated)}  reserved {gib(rec.reserved)}"
      f"  device used {gib(rec.device_used)}  non-torch {gib(rec.non_torch)}")
print("  measured categories: " + ", ".join(f"{k}={v / MiB:.1f} MiB" for k, v in rec.categories.items() if v))
check(rec.peak_allocated >= rec.allocated and rec.device_used >= rec.reserved, "tracker CUDA figures consistent")

if have_hf:
    from engine.memory.estimate import estimate_memory
    from engine.memory.report import build_report

    est = estimate_memory(run_cfg, vocab_size=V, seq_len=T)
    rep = build_report("gpu_check", est, tracker.phase_records())
    print("  estimate vs measured (update phase):")
    for r in rep.comparison:
        if r.phase == "update" and r.measured:
            print(f"    {r.category:12s} est {r.estimate / MiB:10.1f} MiB  measured {r.measured / MiB:10.1f} MiB  "
                  f"diff {r.diff_pct:+6.1f}%")
            tol = 10 if r.category in ("params", "grads", "optimizer") else 25
            check(abs(r.diff_pct) <= tol, f"{r.category} estimate within {tol}% on CUDA")

params_ref = [p.detach().clone() for p in model.parameters()]
state_ref = [v.clone() for p in model.parameters() for v in opt.state[p].values() if torch.is_tensor(v)]
torch.cuda.empty_cache()
a0 = alloc()
t0 = time.perf_counter()
rp = offload_params(model)
ro = offload_optimizer_state(opt)
t_first = time.perf_counter() - t0
a1 = alloc()
moved = rp.param_bytes + rp.grad_bytes_released + ro.optimizer_bytes
print(f"  offload: reports {gib(moved)} (params {gib(rp.param_bytes)}, grads {gib(rp.grad_bytes_released)}, "
      f"optimizer {gib(ro.optimizer_bytes)}); allocator freed {gib(a0 - a1)}")
print(f"    {rp.note}\n    {ro.note}")
check(abs((a0 - a1) - moved) <= 0.02 * moved + (1 << 20), "allocator freed what the reports say moved")
pinned = all(b.is_pinned() for st in _STATES.values() for b in st.host_buffers.values())
check(pinned, "host buffers are pinned")
print(f"  host held: {json.dumps(host_memory_held())}")
onload_params(model, dev)
onload_optimizer_state(opt, dev)
same = all(torch.equal(a, p) for a, p in zip(params_ref, model.parameters()))
same &= all(torch.equal(a, v) for a, v in zip(state_ref, [v for p in model.parameters()
                                                          for v in opt.state[p].values() if torch.is_tensor(v)]))
check(same, "params and optimizer state bit-exact after the round trip")
t0 = time.perf_counter()
offload_params(model)
offload_optimizer_state(opt)
t_again = time.perf_counter() - t0
onload_params(model, dev)
onload_optimizer_state(opt, dev)
print(f"  offload time: first {t_first * 1e3:.1f} ms (allocates pinned buffers), again {t_again * 1e3:.1f} ms "
      f"(reuses them): ratio {t_again / max(t_first, 1e-9):.2f}x of the first")
del model, opt, tracker, params_ref, state_ref
torch.cuda.empty_cache()

# ---------------------------------------------------------------------------------- part 2
print("\n== part 2: Transformer-Engine FP8 weight workspaces")
if te is None:
    print("  SKIPPED: transformer_engine is not importable (see MISSING below)")
elif cap < (8, 9):
    missing.append(f"an FP8-capable GPU (sm >= 8.9; this one is sm {cap[0]}.{cap[1]}): part 2 skipped")
    print("  SKIPPED: no FP8 on this GPU")
else:
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")

    def fp8_ctx():
        if hasattr(te, "fp8_autocast"):
            return te.fp8_autocast(enabled=True, fp8_recipe=recipe)
        return te.autocast(enabled=True, recipe=recipe)

    H, N, TOK = 8192, 8, 4096
    layers = torch.nn.ModuleList([te.Linear(H, H, bias=False, params_dtype=torch.bfloat16, device="cuda")
                                  for _ in range(N)])

    x = torch.randn(TOK, H, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(0))

    def fwd_bwd():
        with fp8_ctx():
            h = x
            for layer in layers:
                h = layer(h, is_first_microbatch=True)      # TE caches FP8 weights only with this flag
        h.float().pow(2).mean().backward()
        out = h.detach()[:4].float().clone()
        del h
        return out

    y0 = fwd_bwd()
    torch.cuda.empty_cache()
    n_ws, ws_bytes = fp8_workspace_bytes(layers)
    param_b = sum(p.numel() * p.element_size() for p in layers.parameters())
    print(f"  {N} x te.Linear({H}, {H}) bf16: params {gib(param_b)}; workspaces found: {n_ws} ({gib(ws_bytes)})")
    check(n_ws == N and ws_bytes > 0, "TE created one cached FP8 workspace per layer")

    before = alloc()
    r_keep = offload_params(layers, clear_fp8=False)
    torch.cuda.empty_cache()
    after_keep = alloc()
    onload_params(layers, dev)
    fwd_bwd()
    torch.cuda.empty_cache()
    before2 = alloc()
    r_clear = offload_params(layers)
    torch.cuda.empty_cache()
    after_clear = alloc()
    print(f"  allocated before offload:                    {gib(before)}  (1.00x)")
    print(f"  allocated after offload without clearing:    {gib(after_keep)}  ({after_keep / before:.2f}x)")
    print(f"  allocated before the second offload:         {gib(before2)}  ({before2 / before:.2f}x)")
    print(f"  allocated after offload with clearing:       {gib(after_clear)}  ({after_clear / before:.2f}x)")
    print(f"  report with clearing: {r_clear.fp8_workspaces_cleared} workspaces, "
          f"{gib(r_clear.fp8_workspace_bytes_freed)}; {r_clear.note}")
    check(r_keep.fp8_workspaces_cleared == 0 and r_clear.fp8_workspaces_cleared == N, "report counts")
    saved = after_keep - after_clear
    check(abs(saved - r_clear.fp8_workspace_bytes_freed) <= 0.05 * r_clear.fp8_workspace_bytes_freed + (8 << 20),
          f"clearing freed what the report says (allocator: {gib(saved)})")
    onload_params(layers, dev)
    y1 = fwd_bwd()
    n2, b2 = fp8_workspace_bytes(layers)
    check(n2 == N and b2 == ws_bytes, "the next forward rebuilt the workspaces")
    check(bool(torch.isfinite(y1).all()), "forward after the round trip is finite")
    print(f"  output drift vs the first forward (FP8 scales update per step): {(y1 - y0).abs().max().item():.3e}")

print("\n== summary")
for m in missing:
    print(f"  MISSING: {m}")
for f in failed:
    print(f"  FAILED: {f}")
if failed:
    sys.exit(1)
sys.exit(2 if missing else 0)
PY
