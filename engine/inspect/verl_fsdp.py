"""Reader for verl's FSDP checkpoints.

Layout (verl.utils.checkpoint.fsdp_checkpoint_manager)::

    <save dir>/latest_checkpointed_iteration.txt      the step verl resumes from
    <save dir>/global_step_N/actor/                     (and critic/)
        model_world_size_W_rank_R.pt                    per-rank sharded state dict (DTensors)
        optim_world_size_W_rank_R.pt                    per-rank optimizer.state_dict()
        extra_state_world_size_W_rank_R.pt              {"lr_scheduler": ..., "rng": ...}
        fsdp_config.json, huggingface/config.json
    <save dir>/global_step_N/data.pt                    dataloader state

Every ``.pt`` is a torch.save archive read with the restricted unpickler. Per-rank pieces
of one tensor are merged into one row (global shape from the DTensor spec).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from engine.errors import CheckpointError
from engine.checkpoint.io.files import dir_size, list_files, read_json
from engine.checkpoint.io.grouping import guess_group
from engine.inspect.report import CheckpointReport, RunReport, StepInfo, TensorInfo
from engine.checkpoint.io.safe_unpickle import UnsafePickleError, read_torch_archive
from engine.inspect.torch_save import entries

RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
STEP_DIR = re.compile(r"^global_step_(\d+)$")
POINTER = "latest_checkpointed_iteration.txt"
COMPONENTS = ("actor", "critic")


def _rank_files(d: Path) -> list[tuple[str, int, int, Path]]:
    out = []
    if d.is_dir():
        for p in d.iterdir():
            m = RANK_FILE.match(p.name)
            if m:
                out.append((m.group(1), int(m.group(2)), int(m.group(3)), p))
    return out


def is_verl_component(path: Path) -> bool:
    """An actor/ or critic/ directory holding per-rank model files."""
    return any(kind == "model" for kind, *_ in _rank_files(path))


def is_verl_step(path: Path) -> bool:
    return path.is_dir() and any(is_verl_component(path / c) for c in COMPONENTS)


def is_verl_run(path: Path) -> bool:
    return path.is_dir() and (path / POINTER).is_file() and any(
        STEP_DIR.match(p.name) for p in path.iterdir())


def _group(kind: str):
    if kind == "model":
        return lambda name, is_tensor: "model"
    if kind == "optim":
        return lambda name, is_tensor: ("optimizer param groups" if ".param_groups." in f".{name}."
                                         else "optimizer state")
    return guess_group


def inspect_verl_step(path: Path, *, display: Optional[str] = None) -> CheckpointReport:
    """Report for ``global_step_N/`` (or one ``actor/``/``critic/`` directory)."""
    shown = display or str(path)
    if is_verl_component(path):
        components = [(path.name, path)]
        step_dir = path.parent
    else:
        components = [(c, path / c) for c in COMPONENTS if is_verl_component(path / c)]
        step_dir = path
    m = STEP_DIR.match(step_dir.name)
    rep = CheckpointReport(path=shown, format="verl-fsdp", files=list_files(path),
                           step=int(m.group(1)) if m else None)
    merged: dict[str, TensorInfo] = {}
    world_sizes: set[int] = set()
    for comp, d in components:
        prefix = "" if comp == "actor" else f"{comp}."
        files = _rank_files(d)
        sizes = {w for _, w, _, _ in files}
        world_sizes |= sizes
        for kind in ("model", "optim", "extra_state"):
            for w in sorted(sizes):
                ranks = sorted(r for k, ww, r, _ in files if k == kind and ww == w)
                missing = sorted(set(range(w)) - set(ranks))
                if missing:
                    rep.complete = False
                    rep.incomplete_reasons.append(
                        f"{comp}/{kind}_world_size_{w}: no file for rank(s) "
                        f"{', '.join(map(str, missing[:8]))}{'...' if len(missing) > 8 else ''}")
        for kind, w, rank, p in sorted(files, key=lambda x: (x[0], x[1], x[2])):
            archive = read_torch_archive(p, display=f"{shown}/{p.relative_to(path)}")
            if kind == "extra_state":
                obj = archive.obj if isinstance(archive.obj, dict) else {"extra": archive.obj}
                if rank == 0 and obj.get("lr_scheduler") is not None:
                    t, o = entries(obj["lr_scheduler"], prefix=f"{prefix}scheduler",
                                   group=lambda *_: "scheduler")
                    rep.tensors.extend(t)
                    rep.objects.extend(o)
                if obj.get("rng") is not None:
                    t, o = entries(obj["rng"], prefix=f"{prefix}rng.rank_{rank}",
                                   group=lambda *_: "rng")
                    rep.tensors.extend(t)
                    rep.objects.extend(o)
                continue
            base = f"{prefix}{'model' if kind == 'model' else 'optim'}"
            t, o = entries(archive.obj, prefix=base, group=_group(kind))
            for ti in t:
                have = merged.get(ti.name)
                if have is None:
                    merged[ti.name] = ti
                else:
                    have.shards += 1
            if rank == 0:
                rep.objects.extend(o)
    rep.tensors[:0] = list(merged.values())
    if world_sizes:
        rep.world_size = max(world_sizes)
        if len(world_sizes) > 1:
            rep.notes.append(f"files for several world sizes: {sorted(world_sizes)}")
    rep.layout = {"components": [c for c, _ in components],
                  "files_per_rank": ["model", "optim", "extra_state"]}
    rep.format_detail = (f"verl FSDP checkpoint ({', '.join(c for c, _ in components)}; "
                         f"world size {rep.world_size})")
    _side_files(rep, step_dir, components)
    return rep


def _side_files(rep: CheckpointReport, step_dir: Path, components) -> None:
    for comp, d in components:
        fc = d / "fsdp_config.json"
        if fc.is_file():
            try:
                rep.info[f"{comp}_fsdp_config"] = read_json(fc, what=f"{comp}/fsdp_config.json")
            except CheckpointError as e:
                rep.notes.append(e.message)
        hf = d / "huggingface" / "config.json"
        if hf.is_file() and rep.config is None:
            try:
                cfg = read_json(hf, what=f"{comp}/huggingface/config.json")
            except CheckpointError as e:
                rep.notes.append(e.message)
                continue
            if isinstance(cfg, dict):
                rep.config = cfg
                if cfg.get("transformers_version"):
                    rep.versions["transformers"] = str(cfg["transformers_version"])
    data = step_dir / "data.pt"
    if data.is_file():
        try:
            archive = read_torch_archive(data, display=f"{step_dir.name}/data.pt")
            t, o = entries(archive.obj, prefix="data", group=lambda *_: "data")
            rep.tensors.extend(t)
            rep.objects.extend(o)
        except UnsafePickleError as e:
            rep.notes.append(f"data.pt not read: {e.message}")


def inspect_verl_run(path: Path, *, display: Optional[str] = None) -> RunReport:
    """Every ``global_step_N`` of a verl save dir, and the one the pointer file names."""
    shown = display or str(path)
    run = RunReport(path=shown, format="verl-run")
    pointer = (path / POINTER).read_text().strip()
    run.info["latest_checkpointed_iteration"] = pointer
    for d in sorted((p for p in path.iterdir() if STEP_DIR.match(p.name)),
                    key=lambda p: int(STEP_DIR.match(p.name).group(1))):
        size, count = dir_size(d)
        step = int(STEP_DIR.match(d.name).group(1))
        info = StepInfo(name=d.name, step=step, complete=True, bytes=size, files=count)
        reasons = []
        comps = [c for c in COMPONENTS if is_verl_component(d / c)]
        if not comps:
            reasons.append("no actor/ or critic/ model files")
        for c in comps:
            files = _rank_files(d / c)
            for w in {w for _, w, _, _ in files}:
                for kind in ("model", "optim", "extra_state"):
                    n = sum(1 for k, ww, _, _ in files if k == kind and ww == w)
                    if n != w:
                        reasons.append(f"{c}: {n}/{w} {kind} files")
        if reasons:
            info.complete = False
            info.reason = "; ".join(reasons)
        info.latest = str(step) == pointer
        if info.latest:
            run.latest = d.name
        run.steps.append(info)
    if run.latest is None:
        run.notes.append(f"{POINTER} says {pointer!r} but there is no global_step_{pointer}/")
    run.files = [f for f in list_files(path / POINTER, relative_to=path)]
    return run
