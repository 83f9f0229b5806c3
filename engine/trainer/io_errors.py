"""What a failed file-system call means for a user: one phrase per errno, and the check that
tells an I/O failure (disk full, read-only, permissions) from a bug."""

from __future__ import annotations

import errno
import os
from pathlib import Path

_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted there",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "a directory is in the way",
    errno.ENOENT: "a part of the path does not exist (or cannot be created there)",
    errno.ENAMETOOLONG: "the path is too long",
    errno.ELOOP: "the path loops through symbolic links",
    errno.EIO: "the device reported an I/O error",
    errno.EEXIST: "a file is in the way",
}


def describe_os_error(e: BaseException) -> str:
    """'the disk is full (No space left on device: /x/y)'."""
    if isinstance(e, OSError):
        reason = _REASONS.get(e.errno or -1, "the operating system refused it")
        where = f": {e.filename}" if e.filename else ""
        return f"{reason} ({e.strerror or e}{where})"
    return str(e)


def disk_error_in(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (itself, its cause/context chain, or a Ray task error's cause),
    if the failure was the file system's; None otherwise."""
    seen = set()
    todo: list = [e]
    while todo:
        x = todo.pop()
        if isinstance(x, (tuple, list)):  # e.g. DCP's per-rank failures: (exception, traceback)
            todo += list(x)
            continue
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in _REASONS:
            return x
        todo += [getattr(x, "cause", None), getattr(x, "exc", None), x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += list(failures.values())
    return None


def file_system_problem(path: Path, need_bytes: int | None) -> OSError | None:
    """After a failure whose exception does not say (torch's zip writer turns ENOSPC into a
    RuntimeError "unexpected pos"): is the file system under ``path`` read-only, or without room
    for ``need_bytes``? Returned as the OSError the write would have raised."""
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    if need_bytes is not None and st.f_bavail * st.f_frsize < need_bytes:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None
