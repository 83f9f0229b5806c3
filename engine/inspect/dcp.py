"""`rl inspect-ckpt` of a torch.distributed.checkpoint directory: what the safe DCP reader
(engine/checkpoint/io/dcp.py) finds, with the non-tensor entries' values shown."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.checkpoint.io.dcp import DcpContents, raise_problems, read_dcp, read_object_values
from engine.checkpoint.io.safe_unpickle import Record
from engine.inspect.report import CheckpointReport


def fill_object_previews(root: Path, c: DcpContents, *, display: Optional[str] = None) -> None:
    """Read every non-tensor entry safely (refusing one that would run code) and show its value."""
    from engine.inspect.torch_save import preview

    values = read_object_values(root, c, display=display)
    for o in c.objects:
        if o.name in values:
            v = values[o.name]
            o.type = _type_name(v)
            o.preview = preview(v)


def _type_name(v) -> str:
    return v.qualname if isinstance(v, Record) else type(v).__name__


def inspect_dcp(path: Path, *, display: Optional[str] = None) -> CheckpointReport:
    """Report for a plain torch.distributed.checkpoint directory."""
    shown = display or str(path)
    c = read_dcp(path, display=shown)
    raise_problems(shown, c.problems)
    fill_object_previews(path, c, display=shown)
    from engine.inspect.coverage import rl_coverage

    rep = CheckpointReport(
        path=shown, format="dcp",
        format_detail=f"torch.distributed.checkpoint directory (metadata version {c.version or '?'})",
        world_size=len(c.writer_ranks) or None,
        layout={"ranks_with_data": len(c.writer_ranks),
                "data_files": sum(1 for f in c.files if f.path.endswith(".distcp"))},
        files=c.files, tensors=c.tensors, objects=c.objects, notes=list(c.notes))
    rep.optimizer = rl_coverage([t.name for t in c.tensors] + [o.name for o in c.objects], None)
    if rep.world_size:
        rep.notes.append("world size = ranks that wrote data files (DCP does not record the "
                         "world size; ranks holding only replicas write nothing)")
    return rep
