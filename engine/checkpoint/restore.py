"""Rank side of a resume (inside RankWorker.load, collective): ``load_rank_state`` builds the
live state with ``engine.checkpoint_state()``, compares it with the checkpoint's DCP metadata
and manifest, loads with a planner that leaves out exactly the optimizer entries that are
backfilled (engine/checkpoint/optimizer_entries.py), and hands the result to
``engine.load_checkpoint_state``. It only uses the TrainEngine interface, so it works for every
backend whose optimizer state is flattened as ``state.<param>.<name>`` /
``param_groups.<param>.<name>`` (FSDP2 via DSD, Megatron). Nothing it reads can run code
(engine/checkpoint/safe_dcp.py)."""

from __future__ import annotations

import time
from pathlib import Path

from engine.checkpoint.layout import StepDir, rng_relpath
from engine.checkpoint.manifest import manifest_step, read_manifest, saved_entries
from engine.checkpoint.optimizer_entries import classify_optimizer_entries, group_names, refuse_missing, split_prefix
from engine.checkpoint.shape_diff import shape_diff
from engine.errors import CheckpointError


def _backfill_planner(skip: set[str]):
    """A DCP load planner that requests everything in the state dict except ``skip`` (flat
    DCP keys), and is strict about the rest: a requested key absent from the checkpoint fails.
    Non-tensor values are unpickled with ``weights_only=True`` (engine/checkpoint/safe_dcp.py),
    never with DCP's default ``weights_only=False``."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from engine.checkpoint.safe_dcp import SafeLoadPlanner

    class BackfillLoadPlanner(SafeLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            super().set_up_planner(state_dict, metadata, is_coordinator)
            self.state_dict = {k: v for k, v in self.state_dict.items() if k not in skip}

        def create_local_plan(self):
            return create_default_local_load_plan(self.state_dict, self.metadata, True)

    return BackfillLoadPlanner()


def _initial(value):
    """AdamW's state before its first update: step 0, zero moments."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, (int, float)):
        return type(value)(0)
    return value


def load_rng_file(path: Path) -> dict:
    """Per-rank RNG state (torch.save of tensors, tuples and numpy's MT19937 state), loaded with
    weights_only=True plus the three numpy globals its state needs."""
    import numpy as np
    import torch

    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    core = getattr(np, "_core", None) or getattr(np, "core")
    allowed.append(core.multiarray._reconstruct)
    from engine.checkpoint.io.files import require_regular_file

    require_regular_file(Path(path), str(path))
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, weights_only=True)
    except Exception as e:  # UnpicklingError, a zip reader RuntimeError, EOFError...: never a traceback
        raise CheckpointError(f"{path} is not a readable RNG state ({type(e).__name__}: {str(e)[:300]}). The "
                              f"checkpoint is damaged (or holds objects other than RNG state, which are not "
                              f"loaded); resume an earlier one.", title="corrupt checkpoint") from None
    if not isinstance(state, dict) or not {"torch", "python", "numpy"} <= set(state):
        raise CheckpointError(f"{path} does not hold an RNG state (keys torch, python, numpy); the checkpoint is "
                              f"damaged.", title="corrupt checkpoint")
    return state


def load_rank_state(step_dir: Path, engine, rank: int, generator, plan: dict) -> dict:
    """Load ``step_dir`` into this rank's engine (collective: every rank calls it).

    Refuses (CheckpointError, before anything is loaded, identically on every rank) a model
    that differs from the checkpoint's and optimizer entries that are absent although the
    manifest says they existed (unless ``plan["allow_partial"]``). Returns what it restored.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from engine.checkpoint.save import set_rng_state

    t0 = time.perf_counter()
    step_dir = Path(step_dir)
    step = StepDir(step_dir, int(plan.get("step", manifest_step(step_dir))))
    manifest = read_manifest(step)
    from engine.checkpoint.io.files import read_json

    trainer_state = read_json(step.trainer_json, what=str(step.trainer_json))
    if not isinstance(trainer_state, dict):
        raise CheckpointError(f"{step.trainer_json} is not a JSON object; the checkpoint is damaged.",
                              title="corrupt checkpoint")
    names, shapes = saved_entries(step.state, str(step.state))

    state = engine.checkpoint_state()   # live, DCP-shaped; a fresh optimizer gets entries for every param
    live_model = state["model"]
    saved_model = split_prefix(names, "model.")
    diff = shape_diff({k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in live_model.items()},
                      {k: shapes.get("model." + k) for k in saved_model})
    lacking, extra = sorted(diff.missing), sorted(diff.unknown)
    mism = [f"{k} (checkpoint {list(have)}, model {list(want)})" for k, have, want in diff.wrong if want is not None]
    if lacking or extra or mism:
        parts = []
        if lacking:
            parts.append(f"weights the checkpoint lacks: {'; '.join(group_names(lacking, 6))}")
        if extra:
            parts.append(f"checkpoint weights this model lacks: {'; '.join(group_names(extra, 6))}")
        if mism:
            parts.append(f"shapes differ: {'; '.join(mism[:6])}")
        raise CheckpointError(f"{step_dir} holds a different model than this config builds ({'. '.join(parts)}). "
                              f"Resume with the model config the run was started with.", title="model differs")

    param_state = manifest["optimizer"].get("param_state") or {}
    entries = classify_optimizer_entries(state["optim"].keys(), split_prefix(names, "optim."), param_state,
                                         set(live_model) | set(param_state))
    if entries.missing and not plan.get("allow_partial"):
        raise refuse_missing(entries.missing, step_dir)
    backfilled = entries.backfilled + (entries.missing if plan.get("allow_partial") else [])

    try:
        from engine.checkpoint.safe_dcp import safe_reader

        dcp.load(state, storage_reader=safe_reader(step.state),
                 planner=_backfill_planner({"optim." + k for k in entries.skip}))
    except CheckpointException as e:  # a BaseException: turn it into an error the CLI prints
        raise CheckpointError(f"Loading {step.state} failed: {load_failure(e)}. The checkpoint does not hold what "
                              f"this run needs (damaged, or written by another version); resume an earlier one.",
                              title="load failed") from None
    for k in entries.reset:
        state["optim"][k] = _initial(state["optim"][k])
    engine.load_checkpoint_state(state)

    sched = trainer_state.get("lr_scheduler")
    if sched:
        engine.lr_scheduler.load_state_dict(sched)
        # the optimizer steps taken, which the learned bucket policy refreshes on (its restored
        # last refresh is counted in them): from 0, a resumed run refit at other steps than the
        # uninterrupted one, and padded to other shapes from then on
        engine._updates = int(sched.get("last_epoch", 0))
    buckets = _restore_buckets(engine, trainer_state.get("learned_buckets"))

    rng_file = step.rng_file(rank)
    rng_source = None
    if rank < manifest["world_size"] and not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing although rank {rank} existed at save (world size "
                              f"{manifest['world_size']}); the checkpoint is damaged.", title="corrupt checkpoint")
    if rng_file.is_file():
        set_rng_state(load_rng_file(rng_file), generator)
        rng_source = rng_relpath(rank)
    return {"rank": rank, "model_tensors": len(live_model),
            "optimizer": {"loaded": len(entries.loaded), "backfilled": backfilled},
            "lr_scheduler": {"last_epoch": (sched or {}).get("last_epoch")},
            "rng": rng_source, "buckets": buckets, "seconds": round(time.perf_counter() - t0, 4)}


def load_failure(e) -> str:
    """What a DCP CheckpointException says went wrong, in one line: the first rank's own exception
    (its str() is a traceback dump cut at an arbitrary length, before the missing key's name)."""
    for _rank, failure in sorted(getattr(e, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        text = " ".join(str(exc).split())
        if text:
            return f"{type(exc).__name__}: {text[:400].rstrip('.')}"
    return " ".join(str(e).split())[:400]


def _restore_buckets(engine, saved) -> str:
    policy = getattr(engine, "bucket_policy", None)
    if policy is None or not isinstance(saved, dict) or not saved:
        return "none"
    if saved.get("policy") != getattr(policy, "name", None):
        return f"fresh ({saved.get('policy')} -> {getattr(policy, 'name', None)})"
    policy.load_state_dict(saved)
    return "restored"
