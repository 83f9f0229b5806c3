"""Saving a checkpoint from every rank, atomically.

Each rank calls ``save_rank_state`` (DCP is collective); it returns the size and content hash
of every file the rank wrote, computed while writing (engine/checkpoint/digest.py). Then the
driver calls ``finalize_checkpoint`` with all ranks' hashes, which writes trainer.json and, last,
manifest.json (sizes, hashes, and a hash of the manifest itself), fsyncs and renames
``.tmp-step_N`` to ``step_N``. A kill at any instant leaves either the previous complete
checkpoint or the new one; never a half one named step_N with a manifest.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.checkpoint.digest import (default_algorithm, hash_file, hashing_writer, json_bytes, seal_manifest,
                                      write_bytes_atomic)
from engine.atomic_files import fsync_dir, fsync_tree, write_json_atomic

if TYPE_CHECKING:
    from engine.checkpoint.manifest import RunManifest
from engine.checkpoint.layout import CHECKPOINT_VERSION, FORMAT, TMP_PREFIX, StepDir, rng_relpath, step_dir_name


def tmp_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"{TMP_PREFIX}{step}"


def rng_state(generator: torch.Generator | None) -> dict:
    import numpy as np

    return {"torch": torch.get_rng_state(),
            "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else None,  # the rank's own GPU
            "python": random.getstate(), "numpy": np.random.get_state(),
            "sampler": generator.get_state() if generator is not None else None}


def own_cuda_rng_state(states: list, current: int, visible: int):
    """The saved CUDA generator state of the rank's own GPU (``current``, its index among the
    ``visible`` GPUs the rank sees): a rank saves only its own (a one-element list), whichever
    index it has. Checkpoints from before kept every visible GPU's (``get_rng_state_all``), which
    restored with ``set_rng_state_all`` fails where the resume sees fewer GPUs than the save did (a
    cluster that kept every GPU visible, resumed under Ray's one GPU per rank) and leaves the
    rank's own generator unrestored where it sees more. From those, the entry at the rank's index
    when the rank sees as many GPUs as the save did (the same indices); otherwise which entry was
    its own is unknown, and none is restored (None)."""
    if len(states) == 1:
        return states[0]
    return states[current] if len(states) == visible and current < visible else None


def set_rng_state(state: dict, generator: torch.Generator | None) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        own = own_cuda_rng_state(state["cuda"], torch.cuda.current_device(), torch.cuda.device_count())
        if own is not None:
            torch.cuda.set_rng_state(own)  # the current device: the rank's
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if generator is not None and state.get("sampler") is not None:
        generator.set_state(state["sampler"])


def prepare_tmp(run_dir: Path, step: int) -> Path:
    """Rank 0, before a save: a clean temp dir for this step."""
    d = tmp_dir(run_dir, step)
    if d.is_symlink() or (os.path.lexists(d) and not d.is_dir()):
        d.unlink()  # never follow a link (or a loop) someone left under our temp name
    elif d.exists():
        shutil.rmtree(d)
    StepDir.at(d).rng.mkdir(parents=True)
    return d


def save_rank_state(run_dir: Path, step: int, state: dict, rank: int, rng: dict) -> dict[str, list]:
    """Collective: every rank writes its shards into the temp dir, plus its RNG. Returns
    ``{relative path: [bytes, hex digest, algorithm]}`` for each file this rank wrote, hashed
    as written (engine/checkpoint/digest.py)."""
    import torch.distributed.checkpoint as dcp

    sd = StepDir(tmp_dir(run_dir, step), step)
    algorithm = default_algorithm()
    writer = hashing_writer(sd.state, algorithm)
    dcp.save(state, storage_writer=writer)
    out = {sd.relative(p): [n, h, algorithm] for p, (n, h) in writer.fs.digests.items()}
    buf = io.BytesIO()
    torch.save(rng, buf)
    data = buf.getvalue()
    out[rng_relpath(rank)] = [len(data), write_bytes_atomic(sd.rng_file(rank), data, algorithm), algorithm]
    return out


def finalize_checkpoint(run_dir: Path, step: int, trainer_state: dict, manifest: "RunManifest | dict",
                        digests: dict[str, list] | None = None) -> Path:
    """After every rank saved: trainer.json, manifest.json last, rename into place.

    ``digests``: what the ranks' ``save_rank_state`` returned, merged. A file on disk without
    one (a writer that did not report it) is hashed by reading it, so the manifest always
    covers every file."""
    sd = StepDir(tmp_dir(run_dir, step), step)
    d = sd.path
    digests = dict(digests or {})
    algorithm = default_algorithm()
    data = json_bytes(trainer_state)
    digests[sd.relative(sd.trainer_json)] = [len(data), write_bytes_atomic(sd.trainer_json, data, algorithm),
                                             algorithm]
    fsync_tree(d)
    files, hashes = {}, {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            rel = sd.relative(p)
            size = p.stat().st_size
            got = digests.get(rel)
            if got is None or int(got[0]) != size or (got[2] if len(got) > 2 else None) != algorithm:
                got = hash_file(p, algorithm)  # a file no writer reported (or hashed otherwise)
            files[rel], hashes[rel] = size, str(got[1])
    body = manifest.to_json() if hasattr(manifest, "to_json") else dict(manifest)  # RunManifest (or a test's dict)
    manifest = {"format": FORMAT, "version": CHECKPOINT_VERSION, "step": step,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **body, "files": files,
                "hashes": {"algorithm": algorithm, "files": hashes}}
    write_json_atomic(sd.manifest_path, seal_manifest(manifest))
    final = run_dir / step_dir_name(step)
    if os.path.lexists(final):  # a leftover with the same name (an incomplete dir, a dangling or looping
        # symlink): move it aside, never merge, never follow
        os.replace(final, run_dir / f".stale-{final.name}-{time.time_ns()}")
    os.replace(d, final)
    fsync_dir(run_dir)
    return final
