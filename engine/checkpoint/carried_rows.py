"""The run's row files carried in each checkpoint, so `rl resume` can put back a row a crash tore.

A step's rows (metrics.jsonl, memory.jsonl, samples.jsonl, validation.jsonl) are appended before
its checkpoint is saved, but an append is not fsynced: a crash (power loss, a kill during the
write) can leave the last row cut mid-line while the checkpoint after it is complete. Resume
used to drop the torn row, and that step's row was gone for good.

So each checkpoint carries, in ``rows.json``, the exact lines every row file gained since the
previous checkpoint (the steps after it, up to the checkpoint's own; the first checkpoint of a
run also its step-0 rows). On resume each row file becomes: its well-formed rows up to the
previous checkpoint's step, then the carried lines, and nothing after the resumed step, so every
step appears exactly once with the bytes the run wrote. A checkpoint without ``rows.json``
(written before it existed) resumes as before: rows after its step and torn rows are dropped.

    carrier = RowCarrier(run_root, after_step=-1)      # the driver, when a run starts (or resumes)
    carrier.write(tmp_step_dir, step)                  # every save, before the manifest
    repair_row_files(run_root, step_dir, step)         # `rl resume` (engine/checkpoint/plan.py)
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.checkpoint.digest import write_bytes_atomic
from engine.checkpoint.run_files import MEMORY_FILE, lines_of, row_step
from engine.errors import CheckpointError

ROWS_FILE = "rows.json"
ROWS_FORMAT = 1
# every append-only row file of a run (engine/tracking, engine/memory/report.py, run_dir.py)
ROW_FILES = ("metrics.jsonl", MEMORY_FILE, "samples.jsonl", "validation.jsonl")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


class RowCarrier:
    """The driver's side: which lines each row file gained since the last checkpoint. Reads
    only the bytes appended since then (the whole file only if it shrank meanwhile)."""

    def __init__(self, root: Path, after_step: int):
        self.root = Path(root)
        self.after = after_step
        self.offsets = {name: _size(self.root / name) for name in ROW_FILES}

    def lines_since(self, name: str, step: int) -> list[str]:
        path = self.root / name
        start = self.offsets[name]
        if not path.is_file():
            return []
        with open(path, "rb") as f:
            if _size(path) < start:  # rewritten shorter meanwhile: read it all, keep the window
                start = 0
            f.seek(start)
            data = f.read()
        text = data.decode(errors="replace")
        lines = text.split("\n")[:-1]  # complete lines only (a torn last one is not a row)
        return [ln for ln in lines if ln.strip() and (s := row_step(ln)) is not None and self.after < s <= step]

    def write(self, step_dir: Path, step: int) -> None:
        """``rows.json`` into the checkpoint being saved (``.tmp-step_N``), then the window moves on."""
        files = {name: self.lines_since(name, step) for name in ROW_FILES}
        payload = {"format": ROWS_FORMAT, "after_step": self.after, "step": step, "files": files}
        write_bytes_atomic(Path(step_dir) / ROWS_FILE, json.dumps(payload).encode())
        self.after = step
        self.offsets = {name: _size(self.root / name) for name in ROW_FILES}


def read_carried(step_dir: Path) -> dict | None:
    """The checkpoint's carried rows, or None (no ``rows.json``: an older checkpoint). The file is
    covered by the manifest's hashes, so what verification passed is what was saved."""
    from engine.checkpoint.io.files import read_json

    path = Path(step_dir) / ROWS_FILE
    if not path.is_file():
        return None
    data = read_json(path, what=f"{Path(step_dir).name}/{ROWS_FILE}")
    files = data.get("files") if isinstance(data, dict) else None
    if not (isinstance(files, dict) and isinstance(data.get("after_step"), int)
            and all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in files.values())):
        raise CheckpointError(f"{path} is not a rows record of rl (after_step, files); the checkpoint is damaged. "
                              f"Resume an earlier checkpoint.", title="corrupt checkpoint")
    return data


def repaired_lines(path: Path, step: int, carried: dict | None) -> tuple[list[str], list[int]]:
    """(the lines ``path`` holds after resuming ``step``, the steps whose rows came from the
    checkpoint because the file lacked them or held them torn)."""
    lines = [ln for ln in lines_of(path) if row_step(ln) is not None]
    mine = (carried or {}).get("files", {}).get(path.name)
    if mine is None:
        return [ln for ln in lines if row_step(ln) <= step], []
    after = carried["after_step"]
    kept = [ln for ln in lines if row_step(ln) <= after]
    present = set(lines)
    restored = sorted({row_step(ln) for ln in mine if ln not in present})
    return kept + list(mine), restored


def missing_rows(root: Path, step_dir: Path, step: int) -> dict[str, list[int]]:
    """Per row file, the steps `rl resume` would put back from the checkpoint (read only)."""
    try:
        carried = read_carried(step_dir)
    except CheckpointError:
        return {}
    out = {}
    for name in ROW_FILES:
        _lines, restored = repaired_lines(Path(root) / name, step, carried)
        if restored:
            out[name] = restored
    return out


def repair_row_files(root: Path, step_dir: Path, step: int) -> dict[str, list[int]]:
    """Rewrite each row file (atomically, only when it changes) as it was right after ``step``'s
    checkpoint: torn rows and rows of later steps gone, rows the checkpoint carries put back.
    Returns the steps restored per file."""
    carried = read_carried(step_dir)
    out = {}
    for name in ROW_FILES:
        path = Path(root) / name
        if not path.is_file() and not (carried or {}).get("files", {}).get(name):
            continue
        lines, restored = repaired_lines(path, step, carried)
        text = "".join(ln + "\n" for ln in lines).encode()
        old = path.read_bytes() if path.is_file() else None
        if old != text:
            write_bytes_atomic(path, text)
        if restored:
            out[name] = restored
    return out
