"""Benchmark: what content hashes cost, per GiB, against reading the same bytes in the same run.

Writes one rl checkpoint of ``--gib`` GiB of float32 tensors with the real save path
(``save_rank_state`` + ``finalize_checkpoint``, one rank, DCP), then measures, interleaved
``--reps`` times (medians reported):

    read         : every file of the step read once into a buffer (the floor any verification pays)
    verify <alg> : engine.checkpoint.verify.verify_step(content=True) (what `rl resume` and
                   `rl inspect-ckpt --verify` run): hash of every byte + structure + cross-checks,
                   for XXH3-128 (xxhash, a dependency) and BLAKE2b-256 (the fallback)
    save <alg>   : dcp.save through the hashing writer (hash while writing)
    save plain   : dcp.save without hashing, same state: save <alg> / save plain is the cost of
                   hashing while writing (each round: one untimed save, then the kinds in rotating
                   order; the first save after the reads is slow whatever its kind)

The files were just written, so reads come from the page cache: these are CPU-bound figures;
on a cold cache verification runs at the disk's read speed or the hash's, whichever is lower.

    OMP_NUM_THREADS=1 python bench/verify_ckpt.py [--gib 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def read_all(step: Path) -> int:
    n = 0
    buf = bytearray(4 << 20)
    for p in sorted(step.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while k := f.readinto(buf):
                    n += k
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import json
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from engine.checkpoint import save
    from engine.checkpoint.digest import BLAKE2B, XXH3, default_algorithm, hash_file, hashing_writer, seal_manifest
    from engine.checkpoint.verify import verify_step

    warnings.simplefilter("ignore")
    numel = int(args.gib * 2**30 / 4)
    per = 16
    state = {"model": {f"w{i}": torch.randn(numel // per) for i in range(per)},
             "optim": {f"param_groups.w{i}.lr": 1e-3 for i in range(per)}}
    tmp = Path(tempfile.mkdtemp(prefix="rl-bench-verify-"))
    try:
        run = tmp / "run"
        save.prepare_tmp(run, 1)
        files = save.save_rank_state(run, 1, state, 0, {"torch": torch.get_rng_state()})
        trainer = {"step": 1, "samples_seen": 1, "data": {"epoch": 0, "index": 1, "samples_seen": 1, "n": 8}}
        step = save.finalize_checkpoint(run, 1, trainer, {
            "samples_seen": 1, "world_size": 1, "engine": "fsdp",
            "optimizer": {"param_state": {f"w{i}": True for i in range(per)}},
            "config": {"data": {"train_batch_size": 1}}}, files)
        manifest = json.loads((step / "manifest.json").read_text())
        size = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
        gib = size / 2**30
        algs = [a for a in (XXH3, BLAKE2B) if a == BLAKE2B or default_algorithm() == XXH3]
        manifests = {}
        for a in algs:  # the same files, described with each algorithm (hashed outside the timing)
            m = dict(manifest)
            m["hashes"] = {"algorithm": a, "files": {rel: hash_file(step / rel, a)[1] for rel in manifest["files"]}}
            manifests[a] = seal_manifest(m)

        t: dict[str, list[float]] = {"read": []}
        for rep in range(args.reps):
            t0 = time.perf_counter()
            read_all(step)
            t["read"].append(time.perf_counter() - t0)
            for a in algs:
                t0 = time.perf_counter()
                v = verify_step(step, manifests[a], content=True)
                t.setdefault(f"verify {a}", []).append(time.perf_counter() - t0)
                assert v.content and not v.problems, v.problems
            saves = [(f"save {a}", (lambda d, a=a: {"storage_writer": hashing_writer(d, a)})) for a in algs]
            saves.append(("save plain", lambda d: {"checkpoint_id": str(d)}))
            # the first save after the reads above is slow whatever its kind (0.4 s -> 1-1.8 s at
            # 0.5 GiB, page-cache churn): one untimed save first, then each kind first in turn
            shift = rep % len(saves)
            for name, make in [("warm-up", saves[-1][1])] + saves[shift:] + saves[:shift]:
                d = tmp / "save-state"
                shutil.rmtree(d, ignore_errors=True)
                t0 = time.perf_counter()
                dcp.save(state, **make(d))
                t.setdefault(name, []).append(time.perf_counter() - t0)
                shutil.rmtree(d)
        med = {k: statistics.median(v) for k, v in t.items()}
        print(f"checkpoint: {size:,} bytes ({gib:.2f} GiB), {len(manifest['files'])} files; medians of "
              f"{args.reps}; torch {torch.__version__}, {os.cpu_count()} cpus, load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"{'read (page cache)':24s} {med['read']:7.3f} s  {med['read'] / gib:7.3f} s/GiB")
        for a in algs:
            k = f"verify {a}"
            print(f"{k:24s} {med[k]:7.3f} s  {med[k] / gib:7.3f} s/GiB   verify/read = {med[k] / med['read']:.2f}")
        for a in algs:
            k = f"save {a}"
            print(f"{k:24s} {med[k]:7.3f} s   save plain {med['save plain']:.3f} s   "
                  f"hashing/plain = {med[k] / med['save plain']:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
