"""Files written so that a crash at any instant leaves the old content or the new, never a mix:
write to a temporary name, fsync, rename over, fsync the directory. Used by checkpoints, the
run directory's records, exports and the dataset fingerprint."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to ``path`` so a crash leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))
