"""`rl inspect-ckpt`: see inside a checkpoint without loading its tensors.

Entry points: :func:`inspect_path` (any supported layout -> a report), :func:`diff_paths`
(two checkpoints -> what changed). Readers live one per format in this package;
:mod:`engine.inspect.detect` picks one. Pickles are read by
:mod:`engine.checkpoint.io.safe_unpickle` only; torch is never imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from engine.inspect.report import CheckpointReport, DiffReport, RunReport

__all__ = ["inspect_path", "inspect_checkpoint", "diff_paths", "CheckpointReport",
           "RunReport", "DiffReport"]


VERIFIABLE = ("rl", "rl-run")


def inspect_path(path: Union[str, Path], *, verify: bool = False) -> Union[CheckpointReport, RunReport]:
    """Report for whatever ``path`` holds: one checkpoint, or a directory of them.
    ``verify``: an rl checkpoint's files are checked against its manifest's content hashes
    first (CheckpointError on any mismatch); other formats record no hashes (UserError)."""
    from engine.errors import UserError
    from engine.inspect.detect import READERS, detect

    p = Path(path)
    fmt = detect(p)
    reader, what = READERS[fmt]
    if verify and fmt not in VERIFIABLE:
        raise UserError(f"--verify checks rl checkpoints against the content hashes their manifest records; "
                        f"{path} is a {what}, which records none. Drop --verify.", title="nothing to verify")
    rep = reader(p, display=str(path), verify=True) if verify else reader(p, display=str(path))
    if isinstance(rep, CheckpointReport):
        from engine.inspect.experts import expert_summary

        moe = expert_summary(rep.tensors)
        if moe is not None:  # mixture of experts: experts per layer, expert and router parameters
            rep.info["experts"] = moe
    return rep


def inspect_checkpoint(path: Union[str, Path], *, verify: bool = False) -> CheckpointReport:
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
        rep = inspect_path(Path(path) / rep.latest, verify=verify)
        rep.notes.append(f"{path} is a run root: using its latest step, {Path(rep.path).name}")
    elif verify:
        rep = inspect_path(path, verify=True)
    return rep


def diff_paths(a: Union[str, Path], b: Union[str, Path]) -> DiffReport:
    """What changed from checkpoint ``a`` to ``b``: tensor keys, shapes, dtypes, config."""
    from engine.inspect.diff import diff_reports

    return diff_reports(inspect_checkpoint(a), inspect_checkpoint(b))
