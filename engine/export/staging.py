"""Write a directory atomically: everything goes into a hidden temporary sibling, is fsynced,
and is renamed into place last. A crash leaves the old directory (or none), never a half one."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine.atomic_files import fsync_dir, fsync_tree
from engine.errors import UserError
from engine.sigterm import sigterm_as_exit


def check_target(out: Path, overwrite: bool, source_step_dir: Path | None = None) -> None:
    """Refuse, before anything is written, to replace a non-empty directory (or anything that is
    not a directory: a file, a FIFO, a device), to write where nothing can be created, and to
    write over or inside the checkpoint being read (see :func:`check_not_in_checkpoint`)."""
    from engine.user_paths import check_output_dir, shown

    if source_step_dir is not None:
        check_not_in_checkpoint(Path(out), Path(source_step_dir))
    st = check_output_dir(out, "--out")
    if st is None:
        return
    if overwrite:
        check_replaceable(Path(out))
        return
    try:
        non_empty = any(Path(out).iterdir())
    except OSError as e:
        raise UserError(f"--out {shown(out)} cannot be listed ({e.strerror or e}). Choose another --out.",
                        title="cannot write there") from None
    if non_empty:
        raise UserError(f"--out {shown(out)} already exists and is not empty. Pass --overwrite to replace it (the "
                        f"old directory is removed only after the new one is complete), or choose another --out.",
                        title="output exists")


def check_replaceable(out: Path) -> None:
    """What --overwrite may replace: not an rl run (another run's checkpoints and metrics would go
    with it), not a directory holding runs one level down, not a checkpoint (a step_N of any run,
    other than its own export directories), and not the working directory or one above it."""
    from engine.checkpoint.layout import EXPORT_DIRS, checkpoint_holding
    from engine.user_paths import shown

    o = Path(os.path.realpath(out))
    cwd = Path(os.path.realpath(os.getcwd()))
    home = Path(os.path.realpath(os.path.expanduser("~")))  # "~" itself when no home is known
    fix = "Choose another --out (a new directory, or one an earlier export wrote)."
    if o == cwd or o in cwd.parents or o == home:
        what = "the working directory" if o == cwd else ("your home directory" if o == home
                                                          else "a directory above the working directory")
        raise UserError(f"--out {shown(out)} is {what}: --overwrite would delete everything in it. {fix}",
                        title="output would replace your files")
    step = checkpoint_holding(o)
    if step is not None and not (o.parent == step and o.name in EXPORT_DIRS):
        raise UserError(f"--out {shown(out)} is {'' if o == step else 'inside '}the checkpoint {step} of the run in "
                        f"{step.parent}/: --overwrite would delete saved training state. {fix}",
                        title="output would replace a checkpoint")
    runs = [o] if _is_run(o) else [d for d in _subdirs(o) if _is_run(d)]
    if runs:
        held = "is an rl run" if runs == [o] else f"holds rl runs ({', '.join(d.name for d in runs[:3])})"
        raise UserError(f"--out {shown(out)} {held}: --overwrite would delete its checkpoints and metrics. {fix}",
                        title="output would replace a run")


def _is_run(d: Path) -> bool:
    """A run's root: its run.json, or a complete checkpoint (a step_N with its manifest); a
    directory of exports named step_N is not one."""
    from engine.checkpoint.layout import RUN_FILE, complete_steps

    return (d / RUN_FILE).is_file() or bool(complete_steps(d))


def _subdirs(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def check_not_in_checkpoint(out: Path, step_dir: Path) -> None:
    """--out may not be the checkpoint, a directory holding it (its run directory, `.`, `/`), or
    a path inside any step of its run other than that step's own export directories (step_N/hf,
    step_N/hf-adapter, which verification skips): anything else there would replace the
    checkpoint's files or make verification refuse the step afterwards."""
    from engine.checkpoint.layout import ASIDE_RE, EXPORT_DIRS, STEP_RE, TMP_STEP_RE
    from engine.user_paths import shown

    o, s = Path(os.path.realpath(out)), Path(os.path.realpath(step_dir))
    fix = (f"Give a directory outside the run (e.g. --out {s.parent.parent / (s.parent.name + '-hf')}), or leave "
           f"--out out for the default {Path(step_dir) / EXPORT_DIRS[0]}.")
    if o == s or o in s.parents:
        what = "the checkpoint being exported" if o == s else "a directory that holds the checkpoint being exported"
        raise UserError(f"--out {shown(out)} is {what} ({step_dir}): writing there would replace it. {fix}",
                        title="output overlaps the checkpoint")
    run_root = s.parent if STEP_RE.match(s.name) else None
    for root in filter(None, (s, run_root)):
        if root not in o.parents:
            continue
        first = o.relative_to(root).parts[0]
        if root == s:
            step = s
        elif STEP_RE.match(first) or TMP_STEP_RE.match(first) or ASIDE_RE.match(first):
            step = root / first
        else:
            continue
        rel = o.relative_to(step).parts
        if len(rel) == 1 and rel[0] in EXPORT_DIRS:
            return  # step_N/hf or step_N/hf-adapter: an export's own place in a step
        where = f"the checkpoint directory {step}" if not rel else f"inside the checkpoint directory {step}"
        raise UserError(f"--out {shown(out)} is {where} of this run: only a step's export directories "
                        f"({', '.join(EXPORT_DIRS)}) may be written there; anything else would replace checkpoint "
                        f"files or make `rl resume` refuse the step. {fix}", title="output overlaps the checkpoint")


def _umask_permissions(root: Path) -> None:
    """mkdtemp makes 0700 and some writers 0600: give the directory and files the permissions
    a plain mkdir/open would (0777/0666 minus the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for p in root.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success it becomes ``out``."""
    with sigterm_as_exit():  # a kill while staging still removes the half-written directory
        with _staged_dir(out) as tmp:
            yield tmp


@contextmanager
def _staged_dir(out: Path) -> Iterator[Path]:
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        from engine.user_paths import os_problem, shown

        raise UserError(f"--out {shown(out)} cannot be created: {shown(e.filename or out.parent)} "
                        f"{os_problem(e) if e.errno != errno.ENOENT else 'cannot be created there'}. Choose a directory you "
                        "can write to.", title="cannot write there") from None
    try:
        yield tmp
        _umask_permissions(tmp)
        fsync_tree(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{int(time.time() * 1000)}"
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - only a file-system failure becomes a UserError; the rest re-raises
        problem = None if isinstance(e, UserError) else write_problem(e, tmp)  # asked before tmp is removed
        if problem is None:
            raise
        from engine.user_paths import shown

        raise UserError(f"--out {shown(out)}: writing the export failed: {problem}. Nothing was left at --out"
                        f"{' (the old directory is unchanged)' if out.exists() else ''}; free space or choose "
                        f"another --out, and export again.", title="cannot write there") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_WRITE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                 errno.EIO: "the device reported an I/O error"}


def write_problem(e: BaseException, where: Path) -> str | None:
    """What a failed write means, when the file system is to blame (None otherwise): an OSError in
    ``e``'s chain, the "os error N" safetensors' Rust writer puts in its message (it raises
    SafetensorError, not OSError), or a file system under ``where`` that is now full or read-only."""
    import re

    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        code = x.errno if isinstance(x, OSError) else None
        m = None if code else re.search(r"os error (\d+)", str(x))
        code = code or (int(m.group(1)) if m else None)
        if code in _WRITE_ERRNOS:
            return f"{_WRITE_ERRNOS[code]} ({os.strerror(code)})"
        x = x.__cause__ or x.__context__
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return f"{_WRITE_ERRNOS[errno.EROFS]} ({os.strerror(errno.EROFS)})"
    if st.f_bavail == 0:
        return f"{_WRITE_ERRNOS[errno.ENOSPC]} ({os.strerror(errno.ENOSPC)})"
    return None
