"""Temporary directories that end with their process, however it ends.

A process that dies without cleaning up (SIGKILL, the kernel's OOM killer, a native crash) leaves
its temporary directories behind. For the vLLM rollout that is a full copy of the policy's weights
in /dev/shm (RAM that stays taken until the host reboots, making the next run likelier to run out)
and the engine's socket files; for `rl eval` of a checkpoint, the checkpoint's weights converted
to a Hugging Face directory in the temp directory. Each OwnedDir holds an exclusive lock on a file inside it for its
owner's life: the kernel drops the lock when the process dies, whatever kills it, and whichever
PID namespace it ran in. So a directory whose lock can be taken has no owner left, and the next
OwnedDir made with the same family of names removes it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

LOCK = ".owner.lock"
#: a lock file younger than this may be one its creator has not locked yet
_SETTLE_S = 60.0


class OwnedDir:
    """``mkdtemp(prefix=prefix, dir=base)``, locked for this process's life; removed by
    ``remove()``, or after this process is gone by the next OwnedDir whose prefix starts with
    ``family``."""

    def __init__(self, prefix: str, base: str | None = None, family: str | None = None):
        base_dir = Path(base or tempfile.gettempdir())
        remove_orphans(base_dir, family or prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=base_dir))
        self._fd: int | None = os.open(self.path / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks: no lock file, so no sweep takes it for an orphan
            os.unlink(self.path / LOCK)
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def remove_orphans(base: Path, family: str) -> list[Path]:
    """Remove the directories ``base/family*`` whose owner is gone (their lock can be taken).
    Directories without a lock file (made otherwise, or by an older rl) are left alone.
    Returns those removed."""
    removed = []
    for d in base.glob(f"{family}*"):
        lock = d / LOCK
        try:
            if time.time() - lock.stat().st_mtime < _SETTLE_S:
                continue
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner is alive
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        finally:
            os.close(fd)
    return removed
