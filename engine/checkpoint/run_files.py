"""The run directory's row files on resume (metrics.jsonl, memory.jsonl): rows after the
resumed step are dropped, and so is a row a kill cut short."""

from __future__ import annotations

from pathlib import Path

from engine import json_safe
from engine.checkpoint.digest import write_bytes_atomic

MEMORY_FILE = "memory.jsonl"
RESUME_LOG = "resumes.jsonl"


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Drop rows whose "step" is after ``last_step``, and rows that are not JSON objects (the
    last row of a run killed mid-write); returns how many were dropped. Rewritten atomically."""
    if not path.is_file():
        return 0
    text = path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if row_step(ln) is not None and row_step(ln) <= last_step]
    if len(keep) != len(lines) or (text and not text.endswith("\n")):
        write_bytes_atomic(path, "".join(ln + "\n" for ln in keep).encode())
    return len(lines) - len(keep)


def row_step(line: str) -> int | None:
    """A row's step (0 when it has none); None when the line is not a JSON object."""
    try:
        row = json_safe.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict):
        return None
    try:
        return int(row.get("step", 0))
    except (ValueError, TypeError, OverflowError):
        return None


def lines_of(path: Path) -> list[str]:
    return [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.is_file() else []


def count_rows_after(path: Path, step: int) -> int:
    return sum(1 for ln in lines_of(path) if (row_step(ln) or 0) > step)


def span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)) else \
        ", ".join(map(str, steps[:10]))
