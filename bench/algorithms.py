"""Held-out accuracy after a fixed step budget, and wall time, for each advantage estimator
on the same task, 3 seeds each; prints a markdown table of medians (docs/algorithms.md).

    python bench/algorithms.py --steps 300 --max-new-tokens 8 task.sort_length=2   # the table in docs/algorithms.md
    python bench/algorithms.py --steps 60 --seeds 0 1 2 --estimators grpo rloo dapo
    python bench/algorithms.py --out /tmp/algos_bench.json        # also keep every run's numbers
    python bench/algorithms.py --table-from /tmp/algos_bench.json # the table of a saved (or partial) run

Each run is a real `rl train` (Ray, gloo, the tiny random-init model), one at a time, with
validation (greedy, on the task's held-out prompts) before training and at the last step.
Wall time is the run's own (`wall_time_s`: config to summary, Ray start included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "dapo", "ppo"]


def run_one(estimator: str, seed: int, args, work: Path) -> dict:
    d = work / f"{estimator}-{seed}"
    cmd = [sys.executable, "-m", "rlcli.main", "train", f"algorithm={estimator}", f"task={args.task}",
           f"trainer.seed={seed}", f"trainer.total_steps={args.steps}", f"trainer.val_freq={args.steps}",
           f"data.train_batch_size={args.prompts}", f"algorithm.rollout_n={args.n}",
           f"rollout.max_new_tokens={args.max_new_tokens}", f"optim.lr={args.lr}",
           "checkpoint.save_final=false", "checkpoint.save_freq=0", f"checkpoint.dir={d}", "--json", *args.extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{estimator} seed {seed} failed:\n{r.stderr[-3000:]}")
    s = json.loads(r.stdout)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val = [r for r in rows if r.get("val_reward") is not None]
    return {"estimator": estimator, "seed": seed, "val_before": s["val_before"], "val_after": s["val_after"],
            "val_reward_after": val[-1]["val_reward"] if val else None,
            "reward_first10": s["reward_first10"], "reward_last10": s["reward_last10"],
            "wall_time_s": s["wall_time_s"], "process_s": time.perf_counter() - t0,
            "entropy_last": rows[-1]["entropy"], "truncated_last": rows[-1].get("truncated_frac"),
            "alarms": [a["kind"] for a in s.get("alarms", [])]}


def table(results: list[dict], estimators: list[str]) -> str:
    lines = ["| estimator | held-out accuracy, median (per seed) | held-out reward, median | "
             "train reward last 10, median | wall time s, median | alarms raised |",
             "|---|---|---|---|---|---|"]
    for e in estimators:
        rs = [r for r in results if r["estimator"] == e]
        if not rs:
            continue
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        per = ", ".join(f"{r['val_after']:.3f}" for r in rs)
        alarms = sorted({a for r in rs for a in r["alarms"]})
        vr = [r["val_reward_after"] for r in rs if r.get("val_reward_after") is not None]
        vr_txt = f"{statistics.median(vr):.3f}" if vr else "-"
        lines.append(f"| `{e}` | **{med('val_after'):.3f}** ({per}) | {vr_txt} | {med('reward_last10'):.3f} | "
                     f"{med('wall_time_s'):.0f} | {', '.join(alarms) or '-'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="sort")
    ap.add_argument("--estimators", nargs="+", default=ESTIMATORS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--out", default="")
    ap.add_argument("--table-from", default="", help="print the table of a results file written by --out")
    ap.add_argument("extra", nargs="*", help="more overrides for every run, e.g. trainer.nprocs=2")
    args = ap.parse_args()
    if args.table_from:
        results = json.loads(Path(args.table_from).read_text())
        print(table(results, [e for e in ESTIMATORS if any(r["estimator"] == e for r in results)]))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="rl-bench-algos-") as tmp:
        for seed in args.seeds:
            for e in args.estimators:
                res = run_one(e, seed, args, Path(tmp))
                results.append(res)
                print(f"{e:13s} seed {seed}: held-out {res['val_before']:.3f} -> {res['val_after']:.3f}, "
                      f"reward last 10 {res['reward_last10']:.3f}, {res['wall_time_s']:.0f} s", file=sys.stderr,
                      flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"task={args.task}, {args.steps} steps x {args.prompts} prompts x {args.n} samples, "
          f"max_new_tokens={args.max_new_tokens}, lr={args.lr}, seeds {args.seeds}\n")
    print(table(results, args.estimators))


if __name__ == "__main__":
    main()
