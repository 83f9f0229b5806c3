"""Benchmark: time from `rl resume` to its first new step, against a fresh `rl train`'s time
to its first step, measured in the same run (interleaved, so machine noise hits both alike).

Both are real CLI processes (Python start, imports, Ray, rank start-up, model build); the
clock starts at launch and stops when the step's row lands in metrics.jsonl. The resume side
additionally plans (manifest + DCP metadata), loads model, optimizer, LR schedule, RNG and
data position on every rank, and truncates metrics. Each repetition:

    fresh:  rl train <args> trainer.total_steps=2 checkpoint.save_freq=1   -> time to step 1
    resume: rl resume <that run> trainer.total_steps=3                     -> time to step 3

Prints the medians, resume/fresh (1.0 = resuming costs nothing over a cold start), and the two
parts only a resume pays: the driver's plan (read in-process here) and the slowest rank's load
(from the ``seconds`` each rank reports into resumes.jsonl).

    OMP_NUM_THREADS=1 python bench/resume.py [--reps 3] [--nprocs 1] [-- extra overrides]
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


def rows(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (FileNotFoundError, ValueError):
        return []


def time_to_step(argv: list[str], metrics: Path, step: int, log: Path) -> tuple[float, int]:
    """Launch ``rl argv``; seconds until metrics.jsonl has a row for ``step``; then wait for exit."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), NO_COLOR="1")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "rlcli.main", *argv], stdout=out, stderr=subprocess.STDOUT,
                             env=env)
        first = None
        while p.poll() is None:
            if first is None and any(r.get("step") == step for r in rows(metrics)):
                first = time.perf_counter() - t0
            time.sleep(0.01)
        if first is None and any(r.get("step") == step for r in rows(metrics)):
            first = time.perf_counter() - t0
    if p.returncode != 0 or first is None:
        raise SystemExit(f"`rl {' '.join(argv)}` failed (exit {p.returncode}); log: {log}\n"
                         + log.read_text()[-3000:])
    return first, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nprocs", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("overrides", nargs="*", help="extra overrides for both runs (e.g. data.train_batch_size=8)")
    args = ap.parse_args()

    from engine.checkpoint.plan import plan_resume

    fresh, resumed, loads, plans = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="rl-bench-resume-") as tmp:
        for i in range(args.reps):
            run = Path(tmp) / f"run{i}"
            base = [f"trainer.nprocs={args.nprocs}", f"checkpoint.dir={run}", *args.overrides]
            t, _ = time_to_step(["train", *base, "trainer.total_steps=2", "checkpoint.save_freq=1"],
                                run / "metrics.jsonl", 1, Path(tmp) / f"train{i}.log")
            fresh.append(t)
            t, _ = time_to_step(["resume", str(run), "trainer.total_steps=3"], run / "metrics.jsonl", 3,
                                Path(tmp) / f"resume{i}.log")
            resumed.append(t)
            log = json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])
            loads.append(max(r["seconds"] for r in log["loaded"]))
            t0 = time.perf_counter()
            plan_resume(run, ["trainer.total_steps=4"])
            plans.append(time.perf_counter() - t0)
            print(f"rep {i + 1}/{args.reps}: fresh -> step 1 {fresh[-1]:.2f} s, resume -> step 3 {resumed[-1]:.2f} s",
                  file=sys.stderr)
    f, r = statistics.median(fresh), statistics.median(resumed)
    pair = statistics.median(b / a for a, b in zip(fresh, resumed))
    out = {"reps": args.reps, "nprocs": args.nprocs, "overrides": args.overrides,
           "fresh_to_first_step_s": fresh, "resume_to_first_step_s": resumed,
           "rank_load_s": loads, "plan_s": plans,
           "fresh_median_s": f, "resume_median_s": r, "ratio_resume_over_fresh": r / f,
           "ratio_median_of_pairs": pair}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"fresh `rl train`  -> first step : {f:7.2f} s  (median of {args.reps})")
    print(f"`rl resume`       -> first step : {r:7.2f} s  (median of {args.reps})")
    print(f"  of which: plan (driver)       : {statistics.median(plans):7.3f} s")
    print(f"            load (slowest rank) : {statistics.median(loads):7.3f} s")
    print(f"resume / fresh                  : {r / f:7.2f}x  (median of per-pair ratios {pair:.2f}x)")


if __name__ == "__main__":
    main()
