"""Benchmark: `rl inspect-ckpt` (metadata only) against a full DCP load of the same checkpoint.

Builds a >= 2 GB torch.distributed.checkpoint directory in a temp dir, then measures in
the same run:

* inspect: ``engine.inspect.inspect_path`` (detect, read ``.metadata`` through the
  restricted unpickler, stat the data files), median of several runs;
* full load: ``torch.distributed.checkpoint.load`` into preallocated tensors, i.e. what a
  user does today to look inside; once with the files in the page cache (just written:
  the loader's best case) and once after dropping them from the cache (posix_fadvise
  DONTNEED; a checkpoint read for the first time);
* inspect of a checkpoint with the same number of tensors but 1/1000 of the bytes, to
  show that the cost follows the number of tensors, not their size.

It prints the times and ratios (goal: inspect >= 50x faster than a full load) and deletes
the checkpoints. Usage::

    OMP_NUM_THREADS=1 python bench/inspect_ckpt.py [--gb 2.0] [--tensors 384] [--dir /tmp]
"""

from __future__ import annotations

import sys

# This file is named like the stdlib's `inspect`; run as a script, its directory is
# sys.path[0] and would shadow it for torch & co. Put the repo root there instead.
sys.path[0] = sys.path[0].rsplit("/bench", 1)[0] if sys.path[0].endswith("/bench") else sys.path[0]

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402


def build_state(total_bytes: int, n_tensors: int):
    """A model + AdamW-like state dict of ``n_tensors`` float32 tensors, ``total_bytes``."""
    import torch

    per = max(1, total_bytes // (4 * n_tensors))
    cols = 1024 if per >= 1024 else per
    rows = max(1, per // cols)
    n_params = n_tensors // 3
    model = {f"layers.{i}.weight": torch.rand(rows, cols) for i in range(n_params)}
    optim = {}
    for i in range(n_params):
        optim[f"state.layers.{i}.weight.exp_avg"] = torch.rand(rows, cols)
        optim[f"state.layers.{i}.weight.exp_avg_sq"] = torch.rand(rows, cols)
        optim[f"param_groups.layers.{i}.weight.lr"] = 1e-3
    for j in range(n_tensors - 3 * n_params):
        model[f"extra.{j}"] = torch.rand(rows, cols)
    return {"model": model, "optim": optim}


def drop_from_page_cache(root: Path) -> bool:
    """Ask the kernel to forget the cached pages of every file under ``root``."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def time_inspect(path: Path, repeats: int) -> tuple[float, int]:
    """Median seconds of ``inspect_path(path)`` after one untimed warm-up call."""
    from engine.inspect import inspect_path

    inspect_path(path)
    times = []
    n = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        rep = inspect_path(path)
        times.append(time.perf_counter() - t0)
        n = len(rep.tensors)
    return statistics.median(times), n


def time_cli(path: Path) -> float:
    """Wall seconds of `python -m rlcli.main inspect-ckpt PATH --json` in a fresh process
    (interpreter start, CLI imports and the inspection)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    from rlcli.main import app

    sub = ["inspect-ckpt"] if len(app.registered_commands) > 1 else []
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlcli.main", *sub, str(path), "--json"], cwd=root,
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def time_full_load(path: Path) -> float:
    """dcp.load of every entry into preallocated tensors shaped from the metadata."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    target: dict = {}
    for key, entry in md.state_dict_metadata.items():
        if hasattr(entry, "size"):
            target[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(path))
    elapsed = time.perf_counter() - t0
    del target
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0,
                    help="checkpoint size in GiB (>= 2 for the issue's figure)")
    ap.add_argument("--tensors", type=int, default=384, help="number of tensors")
    ap.add_argument("--repeats", type=int, default=5, help="inspect runs (median reported)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where to build the checkpoints")
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    total = int(args.gb * 1024**3)
    free = shutil.disk_usage(args.dir).free
    if free < total * 1.5:
        print(f"not enough disk in {args.dir}: {free / 1024**3:.1f} GiB free, need "
              f"{total * 1.5 / 1024**3:.1f}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="rl-bench-inspect-", dir=args.dir))
    try:
        big, small = work / "big", work / "small"
        state = build_state(total, args.tensors)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(big))
        save_s = time.perf_counter() - t0
        del state
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(build_state(total // 1000, args.tensors), checkpoint_id=str(small))
        on_disk = sum(p.stat().st_size for p in big.rglob("*") if p.is_file())
        small_disk = sum(p.stat().st_size for p in small.rglob("*") if p.is_file())

        first_s = time.perf_counter()
        from engine.inspect import inspect_path

        inspect_path(big)
        first_s = time.perf_counter() - first_s
        inspect_s, n_tensors = time_inspect(big, args.repeats)
        cli_s = time_cli(big)
        inspect_small_s, _ = time_inspect(small, args.repeats)
        load_warm_s = time_full_load(big)
        cold = drop_from_page_cache(big)
        t0 = time.perf_counter()
        inspect_path(big)
        inspect_cold_s = time.perf_counter() - t0
        drop_from_page_cache(big)
        load_cold_s = time_full_load(big) if cold else float("nan")

        print(f"checkpoint: {on_disk / 1024**3:.2f} GiB on disk, {n_tensors} tensors "
              f"(+{args.tensors // 3} param-group entries), DCP save took {save_s:.1f} s")
        print(f"{'measure':<48}{'seconds':>12}")
        rows = [
            ("inspect (median of %d)" % args.repeats, inspect_s),
            ("inspect, first call (imports the readers)", first_s),
            ("inspect, files dropped from page cache", inspect_cold_s),
            ("full dcp.load, files in page cache", load_warm_s),
            ("full dcp.load, files dropped from page cache", load_cold_s),
            (f"inspect of {small_disk / 1024**2:.1f} MiB, same tensor count", inspect_small_s),
            ("rl inspect-ckpt --json, fresh process", cli_s),
        ]
        for name, s in rows:
            print(f"{name:<48}{s:>12.4f}")
        print(f"ratio full load / inspect (page cache):      {load_warm_s / inspect_s:8.0f}x")
        if cold:
            print(f"ratio full load / inspect (cold files):      {load_cold_s / inspect_cold_s:8.0f}x")
        print(f"inspect time, {on_disk // max(small_disk, 1)}x the bytes, same tensors: "
              f"{inspect_s / inspect_small_s:.2f}x (cost follows tensor count)")
        print(f"per tensor: {inspect_s / n_tensors * 1e6:.0f} us")
        goal = load_warm_s / inspect_s >= 50
        print(f"goal >= 50x: {'met' if goal else 'NOT met'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
