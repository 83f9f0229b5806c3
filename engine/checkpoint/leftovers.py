"""What interrupted saves and prunes leave in a run directory, and removing it.

Three kinds of directory are never a checkpoint `rl resume` would choose and stay forever if
nothing removes them (docs/checkpoint-format.md):

- ``.tmp-step_N``: a save that did not finish (killed, out of memory, disk full);
- ``.stale-step_N-<ns>``: a same-named leftover a later save moved aside;
- ``.deleting-step_N``: a pruned checkpoint whose deletion was interrupted.

`rl train` and `rl resume` remove those they own once they hold the run's lock
(engine/trainer/run_lock.py): only a leftover nothing has touched since the lock was taken
(its newest entry older than that instant) is removed, so a save another process is still
writing into the directory (a rank of a run whose driver died) is left alone. `rl inspect-ckpt`
lists them (engine/inspect/rl_checkpoint.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from engine.checkpoint.layout import ASIDE_RE, TMP_STEP_RE


def is_leftover(name: str) -> bool:
    return bool(TMP_STEP_RE.match(name) or ASIDE_RE.match(name))


def find_leftovers(run_dir: Path) -> list[Path]:
    """Every leftover directly under ``run_dir``, by name."""
    try:
        return sorted(p for p in Path(run_dir).iterdir() if is_leftover(p.name))
    except OSError:
        return []


def newest_mtime(path: Path) -> float:
    """The newest modification time of ``path`` and everything under it (links not followed)."""
    newest = os.lstat(path).st_mtime
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                try:
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
                except OSError:
                    continue
    return newest


def remove_leftovers(run_dir: Path, older_than: float) -> tuple[list[str], list[str]]:
    """Remove the leftovers untouched since ``older_than`` (a time.time(); the lock holder's
    start). Returns (names removed, names kept because something wrote into them since)."""
    removed, kept = [], []
    for p in find_leftovers(run_dir):
        try:
            if newest_mtime(p) >= older_than:
                kept.append(p.name)
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()  # a link or file under a leftover's name: never followed
            removed.append(p.name)
        except OSError:
            kept.append(p.name)
    return removed, kept


def describe_removed(run_dir: Path, removed: list[str]) -> str:
    shown = ", ".join(removed[:6]) + (f" and {len(removed) - 6} more" if len(removed) > 6 else "")
    return (f"removed {len(removed)} leftover(s) of interrupted saves or prunes from {run_dir}/: {shown} "
            f"(never a checkpoint resume would choose).")
