"""Reader for megatron-core ``dist_checkpointing`` directories (and Megatron save dirs).

A dist checkpoint holds ``metadata.json`` (``sharded_backend``, ``common_backend``), the
sharded state as a torch.distributed.checkpoint directory in the same folder (backend
``torch_dist``: ``.metadata`` + ``__R_T.distcp``), and ``common.pt`` (torch.save of the
non-sharded state: ``iteration``, ``args``, ``checkpoint_version``, param groups...).
Both pickles go through the restricted unpickler; a ``common.pt`` holding classes outside
its allow-list is reported as not read rather than failing the whole inspection.

A Megatron save dir has ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from engine.errors import CheckpointError
from engine.inspect.coverage import megatron_coverage
from engine.checkpoint.io.dcp import raise_problems, read_dcp
from engine.checkpoint.io.files import dir_size, list_files, read_json
from engine.checkpoint.io.grouping import guess_group
from engine.inspect.report import CheckpointReport, ObjectInfo, RunReport, StepInfo
from engine.checkpoint.io.safe_unpickle import Record, UnsafePickleError, read_torch_archive
from engine.inspect.torch_save import entries, to_plain

METADATA = "metadata.json"
ITER_DIR = re.compile(r"^iter_(\d+)$")
POINTER = "latest_checkpointed_iteration.txt"


def is_megatron_dist(path: Path) -> bool:
    if not (path.is_dir() and (path / METADATA).is_file()):
        return False
    try:
        m = read_json(path / METADATA, what=METADATA)
    except CheckpointError:
        return True  # ours to report as corrupt
    return isinstance(m, dict) and "sharded_backend" in m


def is_megatron_run(path: Path) -> bool:
    return path.is_dir() and (path / POINTER).is_file() and any(
        ITER_DIR.match(p.name) or p.name == "release" for p in path.iterdir())


def inspect_megatron(path: Path, *, display: Optional[str] = None) -> CheckpointReport:
    """Report for one megatron-core dist_checkpointing directory."""
    shown = display or str(path)
    meta = read_json(path / METADATA, what=f"{shown}/{METADATA}")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{shown}/{METADATA} is not a JSON object; it is corrupt.",
                              title="corrupt checkpoint")
    backend = meta.get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(
            f"{shown} uses Megatron's {backend!r} sharded backend; rl inspect-ckpt reads "
            "'torch_dist' (megatron-core's default). Convert it with megatron-core's "
            "dist_checkpointing tools first.", title="unsupported checkpoint")
    c = read_dcp(path, display=shown, group=guess_group)
    raise_problems(shown, c.problems)
    rep = CheckpointReport(
        path=shown, format="megatron",
        format_detail=(f"megatron-core dist_checkpointing ({backend} v"
                       f"{meta.get('sharded_backend_version', '?')}, common "
                       f"{meta.get('common_backend', '?')})"),
        files=c.files, tensors=c.tensors, objects=c.objects, notes=list(c.notes))
    rep.info["metadata.json"] = meta
    rep.layout["ranks_with_data"] = len(c.writer_ranks)

    common = path / "common.pt"
    if common.is_file():
        try:
            archive = read_torch_archive(common, display=f"{shown}/common.pt")
        except UnsafePickleError as e:
            rep.notes.append(f"common.pt not read: {e.message}")
        else:
            _read_common(rep, archive.obj)
    else:
        rep.notes.append("no common.pt (iteration, args and param groups are kept there)")
    if rep.step is None:
        m = ITER_DIR.match(path.name)
        rep.step = int(m.group(1)) if m else None
    rep.optimizer = megatron_coverage([t.name for t in rep.tensors])
    return rep


def _read_common(rep: CheckpointReport, obj) -> None:
    if not isinstance(obj, dict):
        return
    it = obj.get("iteration")
    if isinstance(it, int) and not isinstance(it, bool):
        rep.step = it
    if "checkpoint_version" in obj:
        rep.info["checkpoint_version"] = to_plain(obj["checkpoint_version"])
    args = obj.get("args")
    if isinstance(args, Record):
        cfg = to_plain(args)
        rep.config = cfg
        tp = cfg.get("tensor_model_parallel_size")
        pp = cfg.get("pipeline_model_parallel_size")
        ws = cfg.get("world_size")
        if isinstance(ws, int):
            rep.world_size = ws
        for k, v in (("tp", tp), ("pp", pp), ("cp", cfg.get("context_parallel_size")),
                     ("ep", cfg.get("expert_model_parallel_size"))):
            if isinstance(v, int):
                rep.layout[k] = v
        if isinstance(ws, int) and isinstance(tp, int) and isinstance(pp, int) and tp * pp:
            rep.layout["dp"] = ws // (tp * pp * (cfg.get("context_parallel_size") or 1))
    rest = {k: v for k, v in obj.items() if k not in ("args",)}
    t, o = entries(rest, prefix="", group=guess_group)
    rep.tensors.extend(t)
    rep.objects.extend(x for x in o if not x.name.startswith("args"))
    if isinstance(args, Record):
        rep.objects.append(ObjectInfo("args", args.qualname, "other",
                                      preview=f"{len(rep.config or {})} fields"))


def inspect_megatron_run(path: Path, *, display: Optional[str] = None) -> RunReport:
    """Every ``iter_N`` of a Megatron save dir, and the one the pointer file names."""
    shown = display or str(path)
    run = RunReport(path=shown, format="megatron-run")
    pointer = (path / POINTER).read_text().strip()
    run.info["latest_checkpointed_iteration"] = pointer
    dirs = [p for p in path.iterdir() if ITER_DIR.match(p.name) or p.name == "release"]
    for d in sorted(dirs, key=lambda p: int(ITER_DIR.match(p.name).group(1))
                    if ITER_DIR.match(p.name) else -1):
        m = ITER_DIR.match(d.name)
        size, count = dir_size(d)
        info = StepInfo(name=d.name, step=int(m.group(1)) if m else None, complete=True,
                        bytes=size, files=count)
        if not (d / METADATA).is_file():
            info.complete = False
            info.reason = "no metadata.json (not a dist checkpoint, or an unfinished save)"
        elif not (d / ".metadata").is_file():
            info.complete = False
            info.reason = "no .metadata (the sharded save did not finish)"
        info.latest = (m is not None and pointer.isdigit() and int(pointer) == info.step) or \
            (pointer == "release" and d.name == "release")
        if info.latest:
            run.latest = d.name
        run.steps.append(info)
    if run.latest is None:
        run.notes.append(f"{POINTER} says {pointer!r} but no such iteration directory exists")
    run.files = list_files(path / POINTER, relative_to=path)
    return run
