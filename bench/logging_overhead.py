"""Logging overhead: the default job (`rl train`, 40 steps) with every logger on
(console, jsonl, tensorboard, wandb offline, mlflow) against the default loggers (console, jsonl).

Runs are interleaved (default, all, default, all, ...) so that load on a shared machine hits
both alike; each run's step time is the median ``step_time_s`` of its steps after warm-up,
and the overhead is the median over pairs of (all / default - 1). Each all-loggers run also
reports what the fan-out measured itself: seconds spent in the training loop's thread
(``tracking_sync_s``: metrics.jsonl, samples.jsonl, queueing) and in the logger thread
(``tracking_background_s``: TensorBoard, wandb, MLflow calls), as a share of step time.

    python bench/logging_overhead.py                  # 3 pairs of the default job
    python bench/logging_overhead.py --pairs 5 --json
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

ALL = "trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]"
DEFAULT = "trainer.loggers=[console,jsonl]"


def run_once(loggers: str, root: Path, tag: str, extra: list[str]) -> dict:
    run = root / tag
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI")}
    env |= {"WANDB_MODE": "offline", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "rlcli.main", "train", loggers, f"checkpoint.dir={run}", *extra,
                        "--json"], capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{r.stderr[-3000:]}")
    summary = json.loads(r.stdout)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"tag": tag, "wall_s": wall, "step_times": [x["step_time_s"] for x in rows],
            "tracking": summary.get("tracking", {})}


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of each run's median")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*", help="extra overrides for both runs (default job: none)")
    args = ap.parse_args(argv)

    load_before = load()
    results = []
    with tempfile.TemporaryDirectory(prefix="rl-bench-logging-") as tmp:
        for i in range(args.pairs):
            for name, loggers in (("default", DEFAULT), ("all", ALL)):
                res = run_once(loggers, Path(tmp), f"{name}{i}", args.overrides)
                steady = res["step_times"][args.warmup:] or res["step_times"]
                res |= {"name": name, "median_step_s": statistics.median(steady), "steady_total_s": sum(steady),
                        "total_step_s": sum(res["step_times"])}
                results.append(res)
                print(f"  {res['tag']:9s} median step {res['median_step_s'] * 1000:7.1f} ms   wall "
                      f"{res['wall_s']:6.1f} s   load {load()}", file=sys.stderr)
    pairs = [(results[2 * i], results[2 * i + 1]) for i in range(args.pairs)]
    ratios = [b["median_step_s"] / a["median_step_s"] - 1 for a, b in pairs]
    alls = [b for _, b in pairs]
    sync = [b["tracking"].get("tracking_sync_s", 0.0) / b["total_step_s"] for b in alls]
    background = [b["tracking"].get("tracking_background_s", 0.0) / b["total_step_s"] for b in alls]
    out = {
        "pairs": args.pairs,
        "median_step_ms_default": statistics.median(a["median_step_s"] for a, _ in pairs) * 1000,
        "median_step_ms_all": statistics.median(b["median_step_s"] for _, b in pairs) * 1000,
        "overhead_per_pair": ratios,
        "overhead_median": statistics.median(ratios),
        "in_loop_share_median": statistics.median(sync),
        "logger_thread_share_median": statistics.median(background),
        "load_before": load_before, "load_after": load(), "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"default job, {args.pairs} interleaved pairs (load {out['load_before']} -> {out['load_after']}, "
              f"{out['cpus']} cpus)")
        print(f"  median step, console+jsonl:        {out['median_step_ms_default']:.1f} ms")
        print(f"  median step, all five loggers:     {out['median_step_ms_all']:.1f} ms")
        print(f"  overhead (median of pair ratios):  {100 * out['overhead_median']:+.2f} %   "
              f"(pairs: {', '.join(f'{100 * r:+.1f}' for r in ratios)})")
        print(f"  in the loop's thread (self-timed): {100 * out['in_loop_share_median']:.2f} % of step time")
        print(f"  logger thread busy (self-timed):   {100 * out['logger_thread_share_median']:.2f} % of step time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
