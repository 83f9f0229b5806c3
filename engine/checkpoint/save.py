"""Saving a checkpoint from every rank, atomically.

Each rank calls ``save_rank_state`` (DCP is collective); then rank 0 calls
``finalize_checkpoint``, which writes trainer.json and, last, manifest.json, fsyncs and
renames ``.tmp-step_N`` to ``step_N``. A kill at any instant leaves either the previous
complete checkpoint or the new one; never a half one named step_N with a manifest.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import torch

from engine.checkpoint.layout import (FORMAT, MANIFEST, TMP_PREFIX, VERSION, fsync_dir, fsync_tree,
                                      step_dir_name, write_json_atomic)


def tmp_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"{TMP_PREFIX}{step}"


def rng_state(generator: torch.Generator | None) -> dict:
    import numpy as np

    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(), "numpy": np.random.get_state(),
            "sampler": generator.get_state() if generator is not None else None}


def set_rng_state(state: dict, generator: torch.Generator | None) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if generator is not None and state.get("sampler") is not None:
        generator.set_state(state["sampler"])


def prepare_tmp(run_dir: Path, step: int) -> Path:
    """Rank 0, before a save: a clean temp dir for this step."""
    d = tmp_dir(run_dir, step)
    if d.exists():
        shutil.rmtree(d)
    (d / "rng").mkdir(parents=True)
    return d


def save_rank_state(run_dir: Path, step: int, state: dict, rank: int, rng: dict) -> None:
    """Collective: every rank writes its shards into the temp dir, plus its RNG."""
    import torch.distributed.checkpoint as dcp

    d = tmp_dir(run_dir, step)
    dcp.save(state, checkpoint_id=str(d / "state"))
    torch.save(rng, d / "rng" / f"rank_{rank}.pt")


def finalize_checkpoint(run_dir: Path, step: int, trainer_state: dict, manifest: dict) -> Path:
    """Rank 0, after every rank saved: trainer.json, manifest.json last, rename into place."""
    d = tmp_dir(run_dir, step)
    write_json_atomic(d / "trainer.json", trainer_state)
    fsync_tree(d)
    files = {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}
    manifest = {"format": FORMAT, "version": VERSION, "step": step,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **manifest, "files": files}
    write_json_atomic(d / MANIFEST, manifest)
    final = run_dir / step_dir_name(step)
    if final.exists():  # an incomplete leftover with the same name: move it aside, never merge
        os.replace(final, run_dir / f".stale-{final.name}-{int(time.time())}")
    os.replace(d, final)
    fsync_dir(run_dir)
    return final
