"""`rl inspect-ckpt`: see inside a checkpoint without loading its tensors.

Entry points: :func:`inspect_path` (any supported layout -> a report), :func:`diff_paths`
(two checkpoints -> what changed). Readers live one per format in this package;
:mod:`engine.inspect.detect` picks one. Pickles are read by
:mod:`engine.inspect.safe_unpickle` only; torch is never imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from engine.inspect.report import CheckpointReport, DiffReport, RunReport

__all__ = ["inspect_path", "inspect_checkpoint", "diff_paths", "CheckpointReport",
           "RunReport", "DiffReport"]


def inspect_path(path: Union[str, Path]) -> Union[CheckpointReport, RunReport]:
    """Report for whatever ``path`` holds: one checkpoint, or a directory of them."""
    from engine.inspect.detect import READERS, detect

    p = Path(path)
    fmt = detect(p)
    reader, _ = READERS[fmt]
    return reader(p, display=str(path))


def inspect_checkpoint(path: Union[str, Path]) -> CheckpointReport:
    """Like :func:`inspect_path`, but a run root resolves to its latest step.

    Raises CheckpointError when a run root has no step to resolve to.
    """
    from engine.errors import CheckpointError

    rep = inspect_path(path)
    if isinstance(rep, RunReport):
        if rep.latest is None:
            raise CheckpointError(f"{path} is a run root with no complete checkpoint to "
                                  "inspect; pass a step directory explicitly.",
                                  title="no checkpoint")
        rep = inspect_path(Path(path) / rep.latest)
        rep.notes.append(f"{path} is a run root: using its latest step, {Path(rep.path).name}")
    return rep


def diff_paths(a: Union[str, Path], b: Union[str, Path]) -> DiffReport:
    """What changed from checkpoint ``a`` to ``b``: tensor keys, shapes, dtypes, config."""
    from engine.inspect.diff import diff_reports

    return diff_reports(inspect_checkpoint(a), inspect_checkpoint(b))
