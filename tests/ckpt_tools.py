"""Helpers for tests that damage or craft rl checkpoints (tests/test_ckpt_corruption.py, test_resume.py).

``reseal`` is what an attacker (or a careless script) does after editing a checkpoint: recompute
every size and content hash and the manifest's own digest, so that only the semantic
cross-checks and the safe loaders stand between the edit and a resumed run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import stat
from pathlib import Path
from typing import Callable, Optional

from engine.checkpoint.digest import hash_file, seal_manifest


def reseal(step_dir: Path, edit: Optional[Callable[[dict], None]] = None) -> dict:
    """Rewrite ``step_dir/manifest.json`` to match the files now on disk (sizes, hashes,
    digest), after applying ``edit`` to the manifest."""
    man_path = step_dir / "manifest.json"
    m = json.loads(man_path.read_text())
    algorithm = (m.get("hashes") or {}).get("algorithm") or "blake2b-256"
    files, hashes = {}, {}
    for p in sorted(step_dir.rglob("*")):
        if p.name == "manifest.json" or p.is_symlink() or not p.is_file():
            continue
        rel = str(p.relative_to(step_dir))
        files[rel], hashes[rel] = hash_file(p, algorithm)
    m["files"] = files
    m["hashes"] = {"algorithm": algorithm, "files": hashes}
    if edit is not None:
        edit(m)
    m = seal_manifest(m)
    man_path.write_text(json.dumps(m, indent=2))
    return m


def edit_manifest(step_dir: Path, edit: Callable[[dict], None]) -> None:
    """Edit the manifest by hand (its digest is left as it was)."""
    man_path = step_dir / "manifest.json"
    m = json.loads(man_path.read_text())
    edit(m)
    man_path.write_text(json.dumps(m, indent=2))


def tree_state(root: Path) -> dict:
    """Every path under ``root`` (not following links) -> (type, size, mtime, content hash or
    link target): equal before and after means nothing was created, removed or changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = ("file", st.st_size, st.st_mtime_ns, hashlib.blake2b(f.read()).hexdigest())
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode), st.st_mtime_ns)
    return out


class RunsCode:
    """Pickles to a call of ``os.system("touch MARKER")``: loading it with a full unpickler
    (torch.load(weights_only=False), pickle.load) creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_code_in_shard(step_dir: Path, marker: Path, entry: Optional[str] = None) -> str:
    """Replace one non-tensor DCP entry (an optimizer param-group value) with a pickle that
    runs ``touch marker``, as a crafted checkpoint would: the payload is appended to the
    shard, ``.metadata`` points the entry at it, and the manifest is resealed to match.
    Returns the entry's name."""
    import torch

    state = step_dir / "state"
    md = pickle.loads((state / ".metadata").read_bytes())  # our own file, in a test: trusted
    names = [k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata"]
    entry = entry or names[-1]
    buf = io.BytesIO()
    torch.save(RunsCode(marker), buf)
    payload = buf.getvalue()
    (index, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == entry]
    shard = state / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    (state / ".metadata").write_bytes(pickle.dumps(md))
    reseal(step_dir)
    return entry
