"""Soak: does a long run keep its memory, file descriptors, threads and disk flat?

Runs the default job (`rl train` with the embedded defaults) for ``--steps`` RL steps (default
2,000) with a checkpoint every 10 steps and ``checkpoint.keep_last=2``, on a private local Ray
in its own RAY_TMPDIR, and samples the run from outside every ``--every`` steps (default 50),
when a step's row lands in metrics.jsonl, half-way between checkpoints (steps 25, 75, ...):

- resident memory (RSS), open file descriptors, threads and process count of the driver (the
  `rl train` process), the ranks (its ``ray::RankWorker`` descendants) and Ray's own processes
  (GCS, raylet, agents, log monitor, autoscaler monitor, rl's reaper: every other descendant);
- disk use of the run directory, split into checkpoints (``step_*`` and any ``.tmp-/.stale-/
  .deleting-step_*`` of a save in flight) and the append-only logs (metrics.jsonl,
  memory.jsonl, samples.jsonl, ...), and of Ray's session directory (its ``logs/`` apart).

Each series gets a least-squares slope over the samples after the warm-up (``--warmup``, the
first 20 % of the steps), expressed per 1,000 steps, and a verdict against a threshold
(``THRESHOLDS`` below says why each is what it is). The append-only logs are expected to grow
with the step count: their growth is reported as bytes per step, with a ceiling, not as a
flatness check.

    python bench/soak.py                          # 2,000 steps, a table
    python bench/soak.py --steps 200 --every 10 --json --check   # CI-sized (tests/test_soak.py)
    python bench/soak.py -- trainer.nprocs=2     # extra overrides after --

``--check`` exits 1 when a series is not flat; ``--json`` prints every sample, slope and
verdict. Figures: docs/benchmarks.md, "Soak".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20

# per 1,000 steps after the warm-up. A threshold is the growth that would matter over a long
# run, well above what sampling noise gives on a flat series (measured: docs/benchmarks.md):
#   rss: 16 MiB per 1,000 steps = 1.6 GB over 100k steps; a leak of one 16 KiB object per step
#        (a retained batch row, a kept tensor) crosses it. A rank's RSS moves by a few MiB between
#        samples (allocator reuse), which the regression averages out.
#   fds / threads / processes: any steady growth is a leak (one per checkpoint = 100 per 1,000
#        steps); 2 per 1,000 steps leaves room for a connection that opens late once.
#   checkpoint bytes: keep_last bounds them; 5 % of their mean per 1,000 steps allows a sample
#        that catches a save in flight (a third step dir for a moment), nothing that grows.
#   ray session: Ray's logs for this run; 1 MiB per 1,000 steps (a line per step from a rank
#        would be ~100 KiB; a per-step stack trace or event file more).
#   append-only logs: expected to grow; ceiling 64 KiB per step (metrics + memory + samples
#        rows are ~2-5 KiB a step at the default job).
THRESHOLDS = {
    "rss": ("abs", 16 * MiB),
    "heap": ("abs", 16 * MiB),
    "fds": ("abs", 2.0),
    "threads": ("abs", 2.0),
    "procs": ("abs", 2.0),
    "checkpoints": ("rel", 0.05),
    "ray_session": ("abs", 1 * MiB),
}
LOG_BYTES_PER_STEP_CEILING = 64 * 1024
APPEND_ONLY_SUFFIXES = (".jsonl", ".log")


@dataclass(frozen=True)
class Series:
    name: str      # e.g. "ranks.rss"
    kind: str      # a THRESHOLDS key, or "log" (append-only, expected to grow)
    unit: str      # "B", "count"


SERIES = [
    *(Series(f"{g}.rss", "rss", "B") for g in ("driver", "ranks", "ray")),
    *(Series(f"{g}.fds", "fds", "count") for g in ("driver", "ranks", "ray")),
    *(Series(f"{g}.threads", "threads", "count") for g in ("driver", "ranks", "ray")),
    # rank 0's malloc arena (memory.jsonl): still referenced + freed but kept. The sum is what
    # a leak grows, referenced (a kept batch) or not (fragmentation); the split itself moves with
    # the step's data (at the default job +-7 MiB from in use to held and back as responses
    # shorten, the sum flat to 0.1 MiB), so the two parts are sampled and shown, not judged
    Series("ranks.heap_total", "heap", "B"),
    Series("ranks.procs", "procs", "count"),
    Series("ray.procs", "procs", "count"),
    Series("run_dir.checkpoints", "checkpoints", "B"),
    Series("run_dir.logs", "log", "B"),
    Series("ray_session.total", "ray_session", "B"),
    Series("ray_session.logs", "ray_session", "B"),
]


# ---- sampling -----------------------------------------------------------------------------------
def disk_bytes(path: Path, only=None) -> int:
    """Bytes on disk (allocated blocks) under ``path``; files vanishing meanwhile (a checkpoint
    pruned as we walk) are skipped. ``only(relpath) -> bool`` filters top-level entries."""
    total = 0
    try:
        top = list(os.scandir(path))
    except OSError:
        return 0
    for entry in top:
        if only is not None and not only(entry.name):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                for root, _dirs, files in os.walk(entry.path):
                    for f in files:
                        try:
                            total += os.lstat(os.path.join(root, f)).st_blocks * 512
                        except OSError:
                            pass
            else:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    return total


def is_append_only_log(name: str) -> bool:
    return name.endswith(APPEND_ONLY_SUFFIXES)


def is_checkpoint(name: str) -> bool:
    return name.startswith(("step_", ".tmp-step_", ".stale-step_", ".deleting-step_"))


def process_group(proc, driver_pid: int) -> str:
    if proc.pid == driver_pid:
        return "driver"
    try:
        name = proc.name()
    except Exception:
        return "ray"
    return "ranks" if name.startswith("ray::RankWorker") else "ray"


def sample(driver_pid: int, run_dir: Path, ray_tmp: Path, step: int, t: float) -> dict:
    import psutil

    groups = {g: {"rss": 0, "fds": 0, "threads": 0, "procs": 0} for g in ("driver", "ranks", "ray")}
    try:
        root = psutil.Process(driver_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = []
    detail = {}  # per process: where a group's growth comes from
    for p in procs:
        try:
            with p.oneshot():
                group = process_group(p, driver_pid)
                rss, fds, threads = p.memory_info().rss, p.num_fds(), p.num_threads()
                name = p.name() if group != "driver" else "driver"
                if name == "python":  # Ray's Python daemons: name them by their script
                    name = next((os.path.basename(a) for a in p.cmdline()[1:] if a.endswith(".py")), name)
        except psutil.Error:
            continue
        g = groups[group]
        detail[f"{name}[{p.pid}]"] = {"rss": rss, "fds": fds, "threads": threads}
        g["rss"] += rss
        g["fds"] += fds
        g["threads"] += threads
        g["procs"] += 1
    sessions = [s for s in (ray_tmp / "ray").glob("session_2*") if s.is_dir()]
    out = {"step": step, "t": round(t, 3)}
    for g, vals in groups.items():
        for k, v in vals.items():
            out[f"{g}.{k}"] = v
    out["run_dir.checkpoints"] = disk_bytes(run_dir, is_checkpoint)
    out["run_dir.logs"] = disk_bytes(run_dir, is_append_only_log)
    out["run_dir.total"] = disk_bytes(run_dir)
    out["ray_session.total"] = sum(disk_bytes(s) for s in sessions)
    out["ray_session.logs"] = sum(disk_bytes(s / "logs") for s in sessions)
    out["processes"] = detail
    out["ray_session.files"] = {k: v for s in sessions for k, v in file_sizes(s).items()}
    return out


def file_sizes(root: Path) -> dict[str, int]:
    """Size of every regular file under ``root`` (which ones grow), skipping any that vanish."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out[os.path.relpath(path, root)] = st.st_size
    return out


class RowTail:
    """New complete lines of a growing metrics.jsonl (a torn last line waits for its end)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buf = path, 0, b""

    def rows(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


# ---- the run ------------------------------------------------------------------------------------
def run_soak(steps: int, every: int, overrides: list[str], workdir: Path, timeout_s: float = 0,
             progress=None) -> dict:
    """Run the soak's `rl train` under ``workdir`` and sample it; return the samples, the step
    times and the run's exit code."""
    run_dir, ray_tmp = workdir / "run", workdir / "raytmp"
    ray_tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), NO_COLOR="1")
    env.pop("RAY_ADDRESS", None)  # a private local Ray: its processes are the driver's descendants
    argv = [sys.executable, "-m", "rlcli.main", "train", f"trainer.total_steps={steps}", "checkpoint.save_freq=10",
            "checkpoint.keep_last=2", f"checkpoint.dir={run_dir}", *overrides]
    tail, memory = RowTail(run_dir / "metrics.jsonl"), RowTail(run_dir / "memory.jsonl")
    # rank 0's heap at the end of its latest update: the same point of every step. (At "its latest
    # phase end", whichever phase that was, memory moved between in-use and held from sample to
    # sample -- +-7 MiB at the default job -- which a 9-sample slope read as growth.)
    heap = {"ranks.heap_in_use": 0, "ranks.heap_held": 0, "ranks.heap_total": 0}
    # sample half-way between multiples of ``every`` (every=50: steps 25, 75, ...; every=10: 5, 15,
    # ...): never while the checkpoint of a multiple of 10 is being written (a third step dir then)
    phase = every // 2
    samples, step_times = [], []
    t0 = time.monotonic()
    log = workdir / "rl.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[1])
        try:
            while True:
                done = proc.poll() is not None
                for rec in memory.rows():
                    if rec.get("rank") == 0 and rec.get("phase") == "update" and rec.get("heap_in_use") is not None:
                        heap = {"ranks.heap_in_use": rec["heap_in_use"], "ranks.heap_held": rec["heap_held"],
                                "ranks.heap_total": rec["heap_in_use"] + rec["heap_held"]}
                for row in tail.rows():
                    step = int(row.get("step", 0))
                    step_times.append(float(row.get("step_time_s", 0.0)))
                    if step % every == phase and not done:
                        samples.append({**sample(proc.pid, run_dir, ray_tmp, step, time.monotonic() - t0), **heap})
                        if progress:
                            progress(samples[-1])
                if done:
                    break
                if timeout_s and time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the soak run did not finish in {timeout_s:.0f} s; log: {log}")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
    return {"argv": argv[2:], "returncode": proc.returncode, "wall_s": round(time.monotonic() - t0, 1),
            "samples": samples, "step_times": step_times, "log_tail": log.read_text()[-3000:]}


# ---- analysis -----------------------------------------------------------------------------------
def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def analyse(samples: list[dict], steps: int, warmup: float = 0.2, limits: dict | None = None) -> dict:
    """Per series: the slope per 1,000 steps over the samples after the warm-up, its threshold
    (THRESHOLDS, or ``limits[kind]`` in the same units: a short run's tolerances) and a verdict.
    Needs 3 samples after the warm-up."""
    limits = limits or {}
    after = [s for s in samples if s["step"] > warmup * steps]
    result = {"warmup_steps": int(warmup * steps), "samples_used": len(after), "series": {}, "flat": True}
    if len(after) < 3:
        result["flat"] = False
        result["error"] = f"{len(after)} samples after the warm-up; at least 3 are needed (more --steps or a smaller --every)"
        return result
    xs = [s["step"] for s in after]
    for ser in SERIES:
        ys = [float(s[ser.name]) for s in after]
        per_k = slope(xs, ys) * 1000
        mean = statistics.fmean(ys)
        entry = {"kind": ser.kind, "unit": ser.unit, "first": ys[0], "last": ys[-1], "mean": mean,
                 "slope_per_1000_steps": per_k}
        if ser.kind == "log":
            per_step, ceiling = per_k / 1000, limits.get("log", LOG_BYTES_PER_STEP_CEILING)
            entry.update(expected="grows with the step count", bytes_per_step=per_step,
                         limit_bytes_per_step=ceiling, ok=per_step <= ceiling)
        else:
            how, value = THRESHOLDS[ser.kind]
            limit = limits[ser.kind] if ser.kind in limits else (value * mean if how == "rel" else value)
            entry.update(limit_per_1000_steps=limit, ok=per_k <= limit)
        result["series"][ser.name] = entry
        result["flat"] = result["flat"] and entry["ok"]
    return result


def _fmt(v: float, unit: str) -> str:
    if unit == "B":
        return f"{v / MiB:,.2f} MiB"
    return f"{v:,.2f}"


def render(report: dict) -> str:
    a = report["analysis"]
    lines = [f"soak: {report['steps']} steps, sample every {report['every']}, wall {report['run']['wall_s']} s, "
             f"median step {report['median_step_s']:.3f} s, slopes over {a['samples_used']} samples after step "
             f"{a['warmup_steps']}"]
    if "error" in a:
        return "\n".join([*lines, f"error: {a['error']}"])
    lines.append(f"{'series':22} {'after warm-up':>14} {'last':>14} {'slope/1k steps':>16} {'limit':>14}  verdict")
    for name, e in a["series"].items():
        if e["kind"] == "log":
            slope_txt, limit_txt = f"{e['bytes_per_step']:,.0f} B/step", f"{e['limit_bytes_per_step']:,.0f} B/step"
            verdict = ("grows, as expected" if e["ok"] else "GROWS TOO FAST")
        else:
            slope_txt, limit_txt = _fmt(e["slope_per_1000_steps"], e["unit"]), _fmt(e["limit_per_1000_steps"], e["unit"])
            verdict = "flat" if e["ok"] else "NOT FLAT"
        lines.append(f"{name:22} {_fmt(e['first'], e['unit']):>14} {_fmt(e['last'], e['unit']):>14} "
                     f"{slope_txt:>16} {limit_txt:>14}  {verdict}")
    lines.append("all flat" if a["flat"] else "NOT FLAT: see the rows above")
    return "\n".join(lines)


def soak(steps: int = 2000, every: int = 50, warmup: float = 0.2, overrides: list[str] | None = None,
         limits: dict | None = None, keep: Path | None = None, timeout_s: float = 0, progress=None) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="rlsoak", dir="/tmp"))  # short: Ray's socket paths
    try:
        run = run_soak(steps, every, list(overrides or []), workdir, timeout_s, progress)
        report = {"steps": steps, "every": every, "warmup": warmup, "overrides": list(overrides or []),
                  "median_step_s": statistics.median(run["step_times"]) if run["step_times"] else 0.0,
                  "run": {k: v for k, v in run.items() if k not in ("samples", "step_times")},
                  "samples": run["samples"], "analysis": analyse(run["samples"], steps, warmup, limits)}
        if run["returncode"] != 0:
            report["analysis"]["flat"] = False
            report["analysis"]["error"] = f"`rl train` exited {run['returncode']}:\n{run['log_tail']}"
        return report
    finally:
        if keep is not None:
            shutil.copytree(workdir, keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("sockets", "*.sock"))
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=50, help="sample every N steps")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the steps left out of the slopes")
    ap.add_argument("--json", action="store_true", help="print every sample, slope and verdict as JSON")
    ap.add_argument("--check", action="store_true", help="exit 1 when a series is not flat")
    ap.add_argument("--keep", type=Path, help="copy the run directory and Ray's session here afterwards")
    ap.add_argument("--analyse", type=Path, metavar="JSON", help="no run: the table of a saved --json report")
    ap.add_argument("overrides", nargs="*", help="extra `rl train` overrides (after --)")
    args = ap.parse_args()

    def progress(s: dict) -> None:
        print(f"step {s['step']:>5}  ranks rss {s['ranks.rss'] / MiB:8.1f} MiB (heap in use "
              f"{s['ranks.heap_in_use'] / MiB:7.1f}, held {s['ranks.heap_held'] / MiB:6.1f})  driver rss "
              f"{s['driver.rss'] / MiB:7.1f} MiB  fds {s['driver.fds'] + s['ranks.fds'] + s['ray.fds']:4d}  "
              f"run dir {s['run_dir.total'] / MiB:6.1f} MiB  ray session {s['ray_session.total'] / MiB:6.2f} MiB",
              file=sys.stderr, flush=True)

    if args.analyse:
        report = json.loads(args.analyse.read_text())
        report["analysis"] = analyse(report["samples"], report["steps"], args.warmup)
    else:
        report = soak(args.steps, args.every, args.warmup, args.overrides, keep=args.keep, progress=progress)
    print(json.dumps(report, indent=1) if args.json else render(report))
    if args.check and not report["analysis"]["flat"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
