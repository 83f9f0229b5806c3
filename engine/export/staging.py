"""Write a directory atomically: everything goes into a hidden temporary sibling, is fsynced,
and is renamed into place last. A crash leaves the old directory (or none), never a half one."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine.checkpoint.layout import fsync_dir, fsync_tree
from engine.errors import UserError


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, to replace a non-empty directory (or a file)."""
    if out.is_file() or out.is_symlink():
        raise UserError(f"--out {out} is a file. Give a directory path (it is created).", title="output exists")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} already exists and is not empty. Pass --overwrite to replace it (the old "
                        f"directory is removed only after the new one is complete), or choose another --out.",
                        title="output exists")


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
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
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
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
