#!/usr/bin/env bash
# GPU check for the megatron backend (issue 7). Called from bench/gpu_check.sh; runs alone too,
# from the repository root, on a machine with one CUDA device (a few minutes on one H200):
#
#     bash bench/gpu_check_megatron.sh            # MEGATRON_CHECK_TIMEOUT=420 by default
#
# Part 1, bf16 (needs torch with CUDA and megatron-core; Transformer-Engine used if importable):
#   MegatronEngine on one rank (nccl), Llama-style model in bf16. Prints the layer spec (TE or
#   local), log-probs against the transformers generation copy, two optimizer steps through
#   megatron-core's optimizer (loss and grad norm finite, weights moved), peak memory of the
#   update, a DCP checkpoint save/load round trip (bit-exact weights), and offload/onload of
#   params + grad buffers + optimizer state: device memory before / after offload / after onload
#   with ratios, and a bit-exact weight round trip.
# Part 2, FP8 (needs transformer_engine and an FP8-capable GPU, sm >= 8.9):
#   the same engine with engine.fp8=true (TE spec, hybrid delayed scaling). Two steps, FP8
#   weight workspaces held after the step, offload -> the report's workspace count/bytes and
#   what the allocator freed, onload and one more step (workspaces rebuilt). Step time and peak
#   memory printed as ratios against Part 1 (the bf16 baseline measured in this run).
# Missing dependencies print MISSING with what to install; exit code 0 when every part ran and
# passed, 2 when a part was skipped for a missing dependency, 1 when a check failed.
#
# MEGATRON_CHECK_CPU_SMOKE=1 runs Part 1's logic on CPU (gloo, fp32, tiny sizes, no memory
# figures) to check the script itself where there is no GPU.
#
# NOTE: written without access to a GPU; not yet run on one.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec timeout "${MEGATRON_CHECK_TIMEOUT:-420}" python3 - <<'PY'
import gc
import os
import socket
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
GiB = float(1 << 30)
missing, failed = [], []
SMOKE = os.environ.get("MEGATRON_CHECK_CPU_SMOKE") == "1"


def check(ok, what):
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        failed.append(what)


def gib(n):
    return f"{n / GiB:8.3f} GiB"


print("== environment")
print(f"  torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if not torch.cuda.is_available() and not SMOKE:
    print("  MISSING: a CUDA device (and a CUDA build of torch). Nothing to check here.")
    sys.exit(2)
try:
    import megatron.core
    from importlib.metadata import version
    print(f"  megatron-core {version('megatron-core')}")
except ImportError:
    print("  MISSING: megatron-core (pip install 'rl[megatron]', megatron-core>=0.16.1,<0.17)")
    sys.exit(2)
try:
    import transformer_engine  # noqa: F401
    print(f"  transformer_engine {getattr(transformer_engine, '__version__', '?')}")
    have_te = True
except Exception as e:  # noqa: BLE001
    print(f"  MISSING: transformer_engine ({type(e).__name__}); Part 1 uses megatron's local spec, "
          "Part 2 (FP8) is skipped. Install: pip install --no-build-isolation transformer_engine[pytorch]")
    have_te = False
dev = torch.device("cuda", 0) if not SMOKE else torch.device("cpu")
cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (0, 0)
if dev.type == "cuda":
    torch.cuda.set_device(dev)
    print(f"  device: {torch.cuda.get_device_name(dev)}, sm {cap[0]}.{cap[1]}")

import torch.distributed as dist

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                        rank=0, world_size=1)

from engine.batch import SequenceBatch
from engine.config.schema import MegatronEngineConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig
from engine.memory.fp8_workspaces import fp8_workspace_bytes

VOCAB = 32000 if not SMOKE else 101
ROWS, T = (8, 256) if not SMOKE else (4, 32)


def make_cfg(fp8: bool) -> RunConfig:
    cfg = RunConfig()
    cfg.trainer = TrainerConfig(total_steps=10, seed=0, device="cuda" if dev.type == "cuda" else "cpu")
    if SMOKE:
        cfg.model = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=64, dtype="float32")
    else:
        cfg.model = ModelConfig(hidden_size=1024, intermediate_size=2816, num_layers=8, num_attention_heads=16,
                                num_key_value_heads=4, max_position_embeddings=512, dtype="bfloat16")
    cfg.engine = MegatronEngineConfig(fp8=fp8, max_tokens_per_micro_batch=ROWS * T // 2,
                                      use_distributed_optimizer=True)
    cfg.optim = OptimConfig(lr=1e-4, warmup_steps=0, grad_clip=1.0)
    cfg.data.max_prompt_length = T
    cfg.rollout.max_new_tokens = 16
    return cfg


def make_batch(seed: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (ROWS, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (ROWS,), generator=g)
    lengths[0] = T
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    prompt = torch.full((ROWS,), T // 4)
    resp = ((torch.arange(T)[None] >= prompt[:, None]) & attn.bool()).float()
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, T) * resp
    return SequenceBatch(input_ids=ids * attn, attention_mask=attn, response_mask=resp, prompt_lengths=prompt,
                         advantages=adv.contiguous())


class PG:
    """Token-mean policy gradient (one rank: no DP scaling)."""
    needs_entropy = False

    def __call__(self, lp, ent, mb, n_tokens, n_seqs):
        loss = -(mb.advantages * lp * mb.response_mask).sum() / n_tokens
        return loss, {"pg_loss": float(loss)}


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def allocated():
    sync()
    return torch.cuda.memory_allocated() if dev.type == "cuda" else 0


def timed_step(eng, seed):
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    stats = eng.train_step(make_batch(seed), PG())
    sync()
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    return time.perf_counter() - t0, peak, stats


def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def build(fp8):
    from engine.backends.megatron.engine import MegatronEngine

    eng = MegatronEngine(make_cfg(fp8), "", VOCAB, 0, 1, dev, 1)
    eng.build()
    return eng


results = {}

# ---- Part 1: bf16 --------------------------------------------------------------------------
print("== part 1: bf16" + (" (CPU smoke: fp32, tiny)" if SMOKE else ""))
eng = build(fp8=False)
print(f"  layer spec: {'Transformer-Engine' if eng.use_te else 'megatron local'}; optimizer: "
      f"{type(eng.optimizer).__name__}; notes: {eng.notes or '-'}")
check(eng.use_te == (have_te and dev.type == "cuda"), "TE spec used exactly when TE imports on a GPU")
b0 = make_batch(0)
lp, ent = eng.compute_log_probs(b0, with_entropy=True)
with eng.generation_model() as hf, torch.no_grad():
    from engine.algorithms.logprobs import token_log_probs
    logits = hf(input_ids=b0.input_ids.to(dev), attention_mask=b0.attention_mask.to(dev), use_cache=False).logits
    ref_lp, _ = token_log_probs(logits, b0.input_ids.to(dev), 1.0)
err = float(((lp - ref_lp.float().cpu()) * b0.attention_mask).abs().max())
tol = 1e-4 if eng.dtype == torch.float32 else 0.25
check(torch.isfinite(lp).all().item() and err < tol, f"log-probs vs transformers: max abs err {err:.2e} (< {tol})")
before = eng.export_hf_state_dict()
t1, peak1, s1 = timed_step(eng, 1)
t2, peak2, s2 = timed_step(eng, 2)
moved = max(float((eng.export_hf_state_dict()[k].float() - before[k].float()).abs().max()) for k in before)
check(all(torch.isfinite(torch.tensor(v)).item() for v in s2.metrics.values()), f"metrics finite: {s2.metrics}")
check(moved > 0, f"weights moved by the steps (max |dw| {moved:.2e})")
print(f"  step time {t2:.3f} s (first {t1:.3f} s), peak memory during update {gib(peak2)}")
results["bf16"] = (t2, peak2)

# checkpoint round trip through DCP (megatron's optimizer state in HF-named full tensors)
import torch.distributed.checkpoint as dcp

with tempfile.TemporaryDirectory() as d:
    saved_w = eng.export_hf_state_dict()
    dcp.save(eng.checkpoint_state(), checkpoint_id=d)
    timed_step(eng, 3)
    state = eng.checkpoint_state()
    dcp.load(state, checkpoint_id=d)
    eng.load_checkpoint_state(state)
    cov = eng.optimizer_coverage()
    check(same(eng.export_hf_state_dict(), saved_w), "checkpoint save -> step -> load restores weights bit-exactly")
    check(all(cov.values()), f"optimizer state for all {len(cov)} HF parameters")

# offload / onload
eng.cfg.engine.param_offload = eng.cfg.engine.optimizer_offload = True
w = eng.export_hf_state_dict()
m0 = allocated()
rep = eng.offload()
m1 = allocated()
rep2 = eng.onload()
m2 = allocated()
print(f"  memory: before offload {gib(m0)} | after offload {gib(m1)} ({m1 / max(m0, 1):.2f}x) | "
      f"after onload {gib(m2)} ({m2 / max(m0, 1):.2f}x)")
print(f"  offload report: params {gib(rep.param_bytes)}, grads released {gib(rep.grad_bytes_released)}, "
      f"optimizer {gib(rep.optimizer_bytes)}; note: {rep.note}")
if dev.type == "cuda":
    check(m1 < 0.25 * m0, "offload frees most device memory (< 0.25x of before)")
    check(rep.param_bytes > 0 and rep.optimizer_bytes > 0, "report counts params and optimizer state moved")
check(same(eng.export_hf_state_dict(), w), "offload + onload round trip is bit-exact")
timed_step(eng, 4)
del eng
gc.collect()
if dev.type == "cuda":
    torch.cuda.empty_cache()

# ---- Part 2: FP8 ---------------------------------------------------------------------------
print("== part 2: FP8")
if SMOKE or not have_te or cap < (8, 9):
    why = "CPU smoke run" if SMOKE else ("transformer_engine" if not have_te else f"an FP8 GPU (sm {cap[0]}.{cap[1]} < 8.9)")
    print(f"  MISSING: {why}; FP8 part skipped")
    if not SMOKE:
        missing.append("fp8")
else:
    eng = build(fp8=True)
    check(eng.use_te, "FP8 engine uses the TE spec")
    t1, _, _ = timed_step(eng, 1)
    t2, peak, s = timed_step(eng, 2)
    check(all(torch.isfinite(torch.tensor(v)).item() for v in s.metrics.values()), f"FP8 metrics finite: {s.metrics}")
    n_ws, ws_bytes = fp8_workspace_bytes(eng.model)
    print(f"  step time {t2:.3f} s ({t2 / results['bf16'][0]:.2f}x bf16), peak {gib(peak)} "
          f"({peak / max(results['bf16'][1], 1):.2f}x bf16); FP8 workspaces held: {n_ws} ({gib(ws_bytes)})")
    eng.cfg.engine.param_offload = eng.cfg.engine.optimizer_offload = True
    m0 = allocated()
    rep = eng.offload()
    m1 = allocated()
    print(f"  offload: FP8 workspaces cleared {rep.fp8_workspaces_cleared} ({gib(rep.fp8_workspace_bytes_freed)}); "
          f"memory {gib(m0)} -> {gib(m1)} ({m1 / max(m0, 1):.2f}x)")
    check(n_ws > 0 and rep.fp8_workspaces_cleared == n_ws, "param offload clears every FP8 workspace")
    check(fp8_workspace_bytes(eng.model)[0] == 0, "no FP8 workspace left after offload")
    eng.onload()
    timed_step(eng, 3)
    check(fp8_workspace_bytes(eng.model)[0] > 0, "the next FP8 step rebuilds the workspaces")

dist.destroy_process_group()
print("== result:", "FAILED: " + "; ".join(failed) if failed else ("ok, with parts skipped" if missing else "ok"))
sys.exit(1 if failed else (2 if missing else 0))
PY
