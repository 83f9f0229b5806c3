"""Logging overhead: the default job (`rl train`, 40 steps) with every logger on
(console, jsonl, tensorboard, wandb offline, mlflow) against the default loggers (console, jsonl).

Runs are interleaved (default, all, default, all, ...) so that load on a shared machine hits
both alike; each run's step time is the median ``step_time_s`` of its steps after warm-up,
and the overhead is the median over pairs of (all / default - 1). (The baseline keeps jsonl:
the step times are read from metrics.jsonl. Its own cost, written in the driver between
steps, outside ``step_time_s``, is in ``--cpu``'s figures against console only.) Each
all-loggers run also reports what the fan-out measured itself: seconds spent in the
training loop's thread (``tracking_sync_s``: metrics.jsonl, samples.jsonl, queueing) and in
the logger thread (``tracking_background_s``: TensorBoard, wandb, MLflow calls), as a share
of step time.

    python bench/logging_overhead.py                  # 3 pairs of the default job
    python bench/logging_overhead.py --pairs 5 --json
    python bench/logging_overhead.py --cpu            # CPU cost per step of the loggers alone

``--cpu`` runs the default job once, then replays its metrics.jsonl (cycled to ``--steps``
steps, sample rows every 10 steps, one burst of the loggers every BURST_S seconds' worth of
steps, as in a real run) through the fan-out in this process: console only, jsonl, each
background logger alone, and all five, each counted in CPU seconds (this process and its
children: wandb's service) per step, against console only. On a loaded shared machine that
figure is far steadier than step-time differences, and it bounds what the loggers can take
from a step.
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


def cpu_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


REPLAYS = {  # name -> trainer.loggers; the CPU figure is each against console only
    "console": ["console"],
    "jsonl": ["console", "jsonl"],
    "tensorboard": ["console", "tensorboard"],
    "wandb": ["console", "wandb"],
    "mlflow": ["console", "mlflow"],
    "all": ["console", "jsonl", "tensorboard", "wandb", "mlflow"],
}


def replay(loggers: list[str], rows: list[dict], run: Path, steps: int, per_burst: int) -> dict:
    """Feed a real run's step rows (cycled to ``steps`` steps; sample rows every 10 steps)
    through Tracking, ending a burst every ``per_burst`` steps as a real run's BURST_S would."""
    from engine.config.validate import build_run_config
    from engine.tracking.fanout import Tracking
    from engine.events import StepRecord

    cfg = build_run_config({"trainer": {"loggers": loggers}})
    run.mkdir(parents=True)
    t = Tracking(cfg, run)
    t.wait_idle()      # the loggers are open: opening is start-up, not per-step cost
    time.sleep(2.0)    # and wandb's service has settled
    fields = set(StepRecord.__dataclass_fields__)
    samples = [{"step": 0, "prompt": "c:", "response": "cccccc", "reward": 1.0, "advantage": 0.5, "answer": "cccccc"}]
    records = []
    for i in range(steps):
        rec = StepRecord(**{k: v for k, v in rows[i % len(rows)].items() if k in fields} | {"step": i + 1})
        if rec.step % 10 == 0:
            rec.samples = [dict(s, step=rec.step) for s in samples * 4]
        records.append(rec)
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    for rec in records:
        t.on_event(rec)
        if rec.step % per_burst == 0:
            t.wait_idle()
    t.wait_idle()   # every step handled; closing (wandb finish, ...) is teardown, not per-step cost
    out = {"cpu_s": cpu_seconds() - cpu0, "wall_s": time.perf_counter() - wall0, "sync_s": t.sync_s,
           "background_s": t.background_s, "steps": steps}
    t.close()
    return out


def cpu_mode(args) -> int:
    from engine.tracking.fanout import BURST_S

    with tempfile.TemporaryDirectory(prefix="rl-bench-logging-") as tmp:
        base = run_once(DEFAULT, Path(tmp), "default", args.overrides)
        rows = [json.loads(x) for x in (Path(tmp) / "default" / "metrics.jsonl").read_text().splitlines()]
        step_s = statistics.median(base["step_times"][args.warmup:] or base["step_times"])
        per_burst = max(1, round(BURST_S / step_s))   # the steps one burst of the loggers gets in a real run
        print(f"  default run: median step {1000 * step_s:.1f} ms, {per_burst} steps per {BURST_S:g} s burst   "
              f"load {load()}", file=sys.stderr)
        res = {}
        # warm-up: wandb's service process starts with the first run in a process (start-up cost)
        replay(REPLAYS["all"], rows, Path(tmp) / "warmup", 10, per_burst)
        for i in range(args.pairs):
            for name, loggers in REPLAYS.items():
                r = replay(loggers, rows, Path(tmp) / f"replay-{name}{i}", args.steps, per_burst)
                res.setdefault(name, []).append(r)
                print(f"  {name + str(i):13s} cpu {1000 * r['cpu_s'] / r['steps']:.2f} ms/step, in-loop "
                      f"{1000 * r['sync_s'] / r['steps']:.3f} ms/step, logger thread "
                      f"{1000 * r['background_s'] / r['steps']:.2f} ms/step   load {load()}", file=sys.stderr)
    per = {k: statistics.median(r["cpu_s"] / r["steps"] for r in v) for k, v in res.items()}
    sync = {k: statistics.median(r["sync_s"] / r["steps"] for r in v) for k, v in res.items()}
    out = {"median_step_ms_default_run": step_s * 1000, "steps_replayed": args.steps, "steps_per_burst": per_burst,
           "cpu_ms_per_step": {k: v * 1000 for k, v in per.items()},
           "extra_cpu_ms_per_step_vs_console": {k: (v - per["console"]) * 1000 for k, v in per.items()},
           "extra_cpu_share_of_step_all": (per["all"] - per["console"]) / step_s,
           "in_loop_ms_per_step_all": sync["all"] * 1000, "in_loop_share_of_step": sync["all"] / step_s,
           "load": load(), "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"loggers' CPU per step, replaying a default run ({args.steps} steps, {args.pairs} repeats, "
              f"load {out['load']}, {out['cpus']} cpus)")
        print(f"  default job median step (this machine, now): {out['median_step_ms_default_run']:.1f} ms")
        for k in REPLAYS:
            extra = out["extra_cpu_ms_per_step_vs_console"][k]
            print(f"  CPU per step, {k + ':':13s} {out['cpu_ms_per_step'][k]:6.2f} ms  "
                  f"(+{extra:.2f} ms = {100 * extra / out['median_step_ms_default_run']:.2f} % of a step vs console)")
        print(f"  all loggers vs console only: +{100 * out['extra_cpu_share_of_step_all']:.2f} % of a step in CPU")
        print(f"  in the loop's thread:       {out['in_loop_ms_per_step_all']:.3f} ms  "
              f"({100 * out['in_loop_share_of_step']:.2f} % of a step)")
    return 0


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
    ap.add_argument("--cpu", action="store_true", help="CPU per step of the loggers alone (replay; see above)")
    ap.add_argument("--steps", type=int, default=200, help="--cpu: steps per replay (CPU time is counted in 10 ms "
                    "ticks: more steps, finer figures)")
    ap.add_argument("overrides", nargs="*", help="extra overrides for both runs (default job: none)")
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_mode(args)

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
