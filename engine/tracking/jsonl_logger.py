"""``metrics.jsonl``: one row per step (``StepRecord.to_json()``), the run's own record that
`rl resume` truncates and `rl plot` reads. Written in the trainer's thread, before the step's
checkpoint, so a kill between the two never leaves a checkpoint without its row."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def append_line(path: Path, line: str) -> None:
    """Append one line in one write; if the write fails (disk full), cut the file back to where
    it was, so it never ends in half a row (every row file of a run is written this way). Never
    through a symlink, into a FIFO or a device (engine/user_paths.py)."""
    from engine.user_paths import append_to_run_file

    append_to_run_file(path, (line + "\n").encode())


class JsonlLogger:
    name = "jsonl"

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS_FILE

    def write_step(self, row: dict) -> None:
        append_line(self.path, json.dumps(row, default=str))
