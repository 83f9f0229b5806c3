"""The dataset's fingerprint, recorded in the run directory (``dataset.json``) so that
`rl resume` can refuse to continue on different data: the checkpoint's data position indexes
the rows of the dataset the run started with.

Local files and directories are hashed byte for byte (sha256 over sorted relative paths and
contents); a dataset from the HF cache uses the `datasets` fingerprints of its splits.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from engine import json_safe
from engine.atomic_files import write_json_atomic

RECORD = "dataset.json"
_SKIP = (".lock", ".incomplete")


def _files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".") and not f.endswith(_SKIP)]
    return out


def fingerprint_path(path: str, subset: str = "") -> Optional[str]:
    """sha256 of what ``task.path`` names, or None when it names nothing local or cached."""
    p = Path(os.path.expanduser(path))
    h = hashlib.sha256()
    if p.is_file() or p.is_dir():
        for f in ([p] if p.is_file() else _files(p)):
            h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode() + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            h.update(b"\0")
        return h.hexdigest()
    from engine.data.load import open_dataset
    from engine.errors import UserError

    try:
        opened = open_dataset(path, subset=subset)
    except UserError:
        return None
    for name in sorted(opened.splits):
        h.update(f"{name}={opened.splits[name]._fingerprint};".encode())
    return h.hexdigest()


def write_record(run_dir: Path, info: dict) -> None:
    """Record the dataset a run trains on (atomic). Keeps earlier fingerprints a resume accepted."""
    if not info.get("fingerprint"):
        return
    path = Path(run_dir) / RECORD
    before = read_record(run_dir)
    history = list(before.get("previous", [])) if before else []
    if before and before.get("fingerprint") != info["fingerprint"]:
        history.append({k: before.get(k) for k in ("fingerprint", "path", "rows")})
    write_json_atomic(path, {**info, "previous": history})


def read_record(run_dir: Path) -> Optional[dict]:
    try:
        return json_safe.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def dataset_refusals(run_root: Path, cfg) -> list[str]:
    """Why `rl resume` must not continue on the data ``cfg.task`` names now ([] if it may)."""
    rec = read_record(run_root)
    if not rec or not rec.get("fingerprint") or not cfg.task.path:
        return []
    now = fingerprint_path(cfg.task.path, cfg.task.subset)
    if now == rec["fingerprint"] or cfg.task.allow_dataset_change:
        return []
    state = "is gone" if now is None else f"changed (fingerprint {rec['fingerprint'][:12]} -> {now[:12]})"
    return [f"The dataset `{cfg.task.path}` {state} since the run started ({run_root / RECORD}); the checkpoint's "
            f"data position counts rows of the original data. Restore the original data, or continue anyway "
            f"with `rl resume {run_root} task.allow_dataset_change=true`."]
