#!/usr/bin/env bash
# GPU check of the commands users run (issue 40): `rl train` on CUDA, `rl resume` exactness, PPO,
# LoRA, the fused output layer, the micro-batch fitted to the GPU, `--engine megatron`, trainer.mode=one_step_off (single- and multi-turn) and streamed; one summary table. Called from
# bench/gpu_check.sh; runs alone too (CPU smoke: GPU_CHECK_DEVICE=cpu bash bench/gpu_check_train.sh).
#
# Resume exactness: two straight 6-step runs must be bit-identical (else the device is not
# deterministic at all and resume cannot be judged), then 3 steps + `rl resume` to 6 must equal
# them: every metric row (reward, pg_loss, entropy, grad_norm) and every DCP entry of step_6. When
# it differs, the same comparison runs again with CUBLAS_WORKSPACE_CONFIG=:4096:8 and
# torch deterministic algorithms, to tell a kernel choice from a restore problem.
# Exit: 0 all passed, 1 a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV="${GPU_CHECK_DEVICE:-cuda}"
WORK="${OUT:-/tmp}/gpu_check_train"
rm -rf "$WORK" && mkdir -p "$WORK"
SUMMARY="$WORK/summary.tsv"
: > "$SUMMARY"
status=0
BASE=(trainer.device="$DEV" trainer.sample_log_freq=0 checkpoint.keep_last=0)

one() {  # name, limit_s, rl args...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s.%N)
  timeout "$limit" rl "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  local dt=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
  echo -e "$name\t$rc\t$dt" >> "$SUMMARY"
  [ "$rc" = 0 ] || { status=1; tail -20 "$WORK/$name.log"; }
  echo "  $name: exit $rc in $dt s"
}

# independent runs together (small models: the GPU and 16 cores have room; ~7x less wall time)
one train 120 train "${BASE[@]}" trainer.total_steps=6 checkpoint.save_freq=3 checkpoint.dir="$WORK/a" &
one train_again 120 train "${BASE[@]}" trainer.total_steps=6 checkpoint.save_freq=3 checkpoint.dir="$WORK/b" &
one ppo 120 train "${BASE[@]}" algorithm=ppo trainer.total_steps=3 checkpoint.dir="$WORK/ppo" &
one lora 120 train "${BASE[@]}" model.lora.rank=8 model.lora.alpha=16 trainer.total_steps=3 checkpoint.dir="$WORK/lora" &
one megatron 120 train --engine megatron "${BASE[@]}" trainer.total_steps=6 checkpoint.save_freq=3 checkpoint.dir="$WORK/mg" &
one megatron_bf16 120 train --engine megatron "${BASE[@]}" model.dtype=bfloat16 trainer.total_steps=3 checkpoint.dir="$WORK/mgbf" &
one one_step_off 120 train "${BASE[@]}" trainer.mode=one_step_off trainer.total_steps=4 checkpoint.dir="$WORK/osp" &
one one_step_off_tools 120 train "${BASE[@]}" task=tool_add rollout.max_turns=3 trainer.mode=one_step_off \
    trainer.total_steps=4 checkpoint.dir="$WORK/ospt" &
one streamed 120 train "${BASE[@]}" trainer.mode=streamed trainer.total_steps=4 checkpoint.dir="$WORK/str" &
one fused_head 120 train "${BASE[@]}" engine.fused_lm_head=true model.dtype=bfloat16 trainer.total_steps=3 \
    checkpoint.dir="$WORK/fh" &
# the micro-batch fitted to the GPU's free memory (engine.max_tokens_per_micro_batch=0): a bf16
# 135M-parameter shape at 1024-token sequences, so the fit has something to fit (GPU only: too big for the CPU smoke)
[ "$DEV" = cuda ] && one fit 120 train "${BASE[@]}" engine.max_tokens_per_micro_batch=0 model.hidden_size=1024 \
    model.intermediate_size=2816 model.num_layers=12 model.num_attention_heads=16 model.num_key_value_heads=4 \
    model.dtype=bfloat16 model.max_position_embeddings=1088 data.train_batch_size=64 rollout.max_new_tokens=1000 \
    rollout.ignore_eos=true trainer.total_steps=2 checkpoint.dir="$WORK/fit" &
wait
grep -qv $'\t0\t' "$SUMMARY" && status=1
mkdir -p "$WORK/r" && cp -r "$WORK/a/." "$WORK/r/" && rm -rf "$WORK/r/step_6"
one resume 90 resume "$WORK/r" &
# megatron's resume: its DistributedOptimizer's Adam state (the GPU default) restored, not restarted
mkdir -p "$WORK/mgr" && cp -r "$WORK/mg/." "$WORK/mgr/" && rm -rf "$WORK/mgr/step_6"
one megatron_resume 90 resume "$WORK/mgr" &
wait
grep -qv $'\t0\t' "$SUMMARY" && status=1

python3 - "$WORK" <<'EOF' || status=1
import json, sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

work = Path(sys.argv[1])
KEYS = ("reward_mean", "pg_loss", "entropy", "grad_norm")


def rows(run):
    p = work / run / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def state(run):
    d = work / run / "step_6" / "state"
    if not d.exists():
        return {}
    out = work / f"{run}.pt"
    dcp_to_torch_save(str(d), str(out))
    sd = torch.load(out, weights_only=False)
    return {f"{t}.{k}": v for t, x in sd.items() for k, v in x.items() if isinstance(v, torch.Tensor)}


def diff(x, y):
    out = []
    for a, b in zip(rows(x), rows(y)):
        bad = {k: (a[k], b[k]) for k in KEYS if a.get(k) != b.get(k)}
        if bad:
            out.append(f"step {a['step']}: {bad}")
    sa, sb = state(x), state(y)
    if set(sa) != set(sb):
        out.append(f"state entries differ: {sorted(set(sa) ^ set(sb))[:5]}")
    worst = max(((float((sa[k].float() - sb[k].float()).abs().max()), k) for k in sa if k in sb
                 and not torch.equal(sa[k], sb[k])), default=None)
    if worst:  # weights apart from optimizer state: equal weights with unequal moments mean the
        # gradients differed in the last bits (a kernel's adding order) and the weights absorbed it
        differ = [k for k in sa if k in sb and not torch.equal(sa[k], sb[k])]
        model = sum(k.startswith("model.") for k in differ)
        out.append(f"{len(differ)} state tensors differ ({model} of the model's, {len(differ) - model} of the "
                   f"optimizer's), worst {worst}")
    return out


ok = True
straight = diff("a", "b")
print("straight vs straight:", "bit-identical" if not straight else straight)
resumed = diff("a", "r")
print("straight vs 3 + resume:", "bit-identical" if not resumed else resumed)
ok = not straight and not resumed
if rows("a") and rows("r") and (straight or resumed):  # what the deterministic re-run below is for
    (work / "resume_differs").touch()
mg, mgr = rows("mg"), rows("mgr")
if mg and mgr:  # steps 4-6: resumed from step_3's checkpoint against the straight run
    rel = max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for a, b in zip(mg[3:], mgr[3:]) for k in KEYS
              if isinstance(a.get(k), float) and isinstance(b.get(k), float))
    print(f"megatron straight vs 3 + resume, steps 4-6: largest relative difference {rel:.2e} "
          f"({'equal' if rel == 0 else 'within 1e-3' if rel <= 1e-3 else 'DIFFERS: Adam state not restored?'})")
    ok = ok and rel <= 1e-3
osp = rows("osp")
if osp:
    st = [r.get("staleness", {}).get("max") for r in osp]
    print(f"one_step_off staleness per step: {st}; step-1 ratio max {osp[0]['algo'].get('rollout_ratio_max')}")
    ok = ok and st == [0, 1, 1, 1]
ospt = rows("ospt")  # multi-turn: every turn on the rollout worker, one version a batch
if ospt:
    st = [r.get("staleness", {}).get("max") for r in ospt]
    print(f"one_step_off multi-turn staleness per step: {st}; turns {[r['algo'].get('agent_turns_mean') for r in ospt]}; "
          f"step-1 ratio max {ospt[0]['algo'].get('rollout_ratio_max')}")
    ok = ok and st == [0, 1, 1, 1]
strm = rows("str")  # trainer.mode=streamed: on-policy, the update on groups as they complete
if strm:
    st = [r.get("staleness", {}).get("max") for r in strm]
    print(f"streamed staleness per step: {st}; ratio max {[r['algo'].get('rollout_ratio_max') for r in strm]}; "
          f"update after the rollout {[round(r['timing'].get('update_after_rollout', 0), 3) for r in strm]} s "
          f"of {[round(r['timing'].get('update', 0), 3) for r in strm]}")
    ok = ok and st == [0, 0, 0, 0]
fit = rows("fit")
if fit:  # the fitted budget against what the update then took on the device
    log = (work / "fit.log").read_text()
    line = " ".join(log.split("engine.max_tokens_per_micro_batch", 1)[1].split())[:200] if "fitted" in log else "?"
    peak = max(r["peak_mem_bytes"] for r in fit)
    print(f"fitted micro-batch: {line}; measured peak {peak / 2**30:.2f} GiB of "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0:.1f} GiB, "
          f"micro-batch shapes {fit[-1].get('micro_batch_shapes')}")
for name in ("train", "ppo", "lora", "mg", "mgbf", "fh"):
    r = rows(name if name != "train" else "a")
    if r:
        print(f"{name:6s} reward {r[0]['reward_mean']:.3f} -> {r[-1]['reward_mean']:.3f}, step {r[-1]['step_time_s']:.2f} s, "
              f"peak {r[-1]['peak_mem_bytes'] / 2**20:.0f} MiB")
sys.exit(0 if ok else 1)
EOF
[ -e "$WORK/resume_differs" ] && {
  # tell a kernel choice from a restore problem: the same comparison with deterministic kernels
  echo "  resume differs: again with CUBLAS_WORKSPACE_CONFIG=:4096:8 and deterministic algorithms"
  export CUBLAS_WORKSPACE_CONFIG=:4096:8 RL_DETERMINISTIC=1
  one det_train 90 train "${BASE[@]}" trainer.total_steps=6 checkpoint.save_freq=3 checkpoint.dir="$WORK/da"
  mkdir -p "$WORK/dr" && cp -r "$WORK/da/." "$WORK/dr/" && rm -rf "$WORK/dr/step_6"
  one det_resume 90 resume "$WORK/dr"
  python3 - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
r = lambda d: [json.loads(x) for x in (w / d / "metrics.jsonl").read_text().splitlines() if x.strip()]
a, b = r("da"), r("dr")
print("deterministic kernels, straight vs resume:",
      "equal" if [x["grad_norm"] for x in a] == [x["grad_norm"] for x in b] else "differ",
      [x["grad_norm"] for x in a[3:]], [x["grad_norm"] for x in b[3:]])
EOF
}
echo "== summary (name, exit, seconds)"
column -t "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
exit $status
