"""The dataset's fingerprint, recorded in the run directory (``dataset.json``) so that
`rl resume` can refuse to continue on different data: the checkpoint's data position indexes
the rows of the dataset the run started with.

Local files and directories are hashed byte for byte (over sorted relative paths and contents);
a dataset from the HF cache uses the `datasets` fingerprints of its splits. The hash is XXH3-128
(``xxhash``, a core dependency: ~10x sha256's speed on a large dataset read at every start),
recorded with the digest as ``fingerprint_algorithm``.

Records written before rl used XXH3 hold a sha256 digest and no ``fingerprint_algorithm``: a
record is always compared by recomputing its own algorithm, so their resumes still pass on the
same data (and refuse changed data). The next record written for such a run is XXH3; when the
data is unchanged it is not listed as a previous dataset.
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
XXH3 = "xxh3-128"
SHA256 = "sha256"  # the algorithm of records without `fingerprint_algorithm` (rl before XXH3)


def _new_hash(algorithm: str):
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == XXH3:
        import xxhash

        return xxhash.xxh3_128()
    from engine.errors import ConfigError

    raise ConfigError(f"dataset.json names the fingerprint algorithm {algorithm!r}, which this rl does not know "
                      f"(known: {XXH3}, {SHA256}); the record is damaged or from a newer rl.",
                      title="unsupported dataset record")


def record_algorithm(record: dict) -> str:
    """The algorithm a record's fingerprint was made with (sha256 for records that do not say)."""
    return record.get("fingerprint_algorithm") or SHA256


def _files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".") and not f.endswith(_SKIP)]
    return out


def fingerprint_path(path: str, subset: str = "", algorithm: str = XXH3) -> Optional[str]:
    """The digest of what ``task.path`` names (``algorithm``: XXH3-128, or sha256 to compare with
    an old record), or None when it names nothing local or cached."""
    p = Path(os.path.expanduser(path))
    h = _new_hash(algorithm)
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
    """Record the dataset a run trains on (atomic). Keeps earlier fingerprints a resume accepted;
    an older record of the same data in another algorithm (sha256) is replaced, not kept."""
    if not info.get("fingerprint"):
        return
    info = {**info, "fingerprint_algorithm": info.get("fingerprint_algorithm") or XXH3}
    path = Path(run_dir) / RECORD
    before = read_record(run_dir)
    history = list(before.get("previous", [])) if before else []
    if before and before.get("fingerprint") and not _same_data(before, info):
        history.append({k: before.get(k) for k in ("fingerprint", "path", "rows")} |
                       {"fingerprint_algorithm": record_algorithm(before)})
    write_json_atomic(path, {**info, "previous": history})


def _same_data(before: dict, now: dict) -> bool:
    algorithm = record_algorithm(before)
    if algorithm == now["fingerprint_algorithm"]:
        return before["fingerprint"] == now["fingerprint"]
    if before.get("path") != now.get("path"):
        return False
    return fingerprint_path(now["path"], now.get("subset") or "", algorithm) == before["fingerprint"]


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
    now = fingerprint_path(cfg.task.path, cfg.task.subset, record_algorithm(rec))  # the record's own algorithm
    if now == rec["fingerprint"] or cfg.task.allow_dataset_change:
        return []
    state = "is gone" if now is None else f"changed (fingerprint {rec['fingerprint'][:12]} -> {now[:12]})"
    return [f"The dataset `{cfg.task.path}` {state} since the run started ({run_root / RECORD}); the checkpoint's "
            f"data position counts rows of the original data. Restore the original data, or continue anyway "
            f"with `rl resume {run_root} task.allow_dataset_change=true`."]
