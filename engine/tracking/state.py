"""``tracking.json`` in the run directory: the ids that let `rl resume` continue the same
wandb and MLflow runs. Written atomically when a logger first creates its run."""

from __future__ import annotations

from pathlib import Path

from engine import json_safe
from engine.atomic_files import write_json_atomic

STATE_FILE = "tracking.json"


def read_state(run_dir: Path) -> dict:
    p = Path(run_dir) / STATE_FILE
    if not p.exists():
        return {}
    try:
        state = json_safe.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}  # a damaged file ([], "x"): no ids, new logger runs


def update_state(run_dir: Path, **values) -> None:
    state = read_state(run_dir) | values
    write_json_atomic(Path(run_dir) / STATE_FILE, state)
