"""Carrying out a resume plan (engine/checkpoint/plan.py) once the ranks are up: check the
prompt set against the saved data position, have every rank load its state
(engine/checkpoint/restore.py), compare what the ranks backfilled with the plan, restore the data
position, and rewrite the run directory (newer checkpoints set aside, row files repaired, the
resume logged in resumes.jsonl)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoint.carried_rows import repair_row_files
from engine.checkpoint.resume_checks import backfill_warnings, prompt_set_refusal
from engine.checkpoint.run_files import RESUME_LOG
from engine.errors import CheckpointError

if TYPE_CHECKING:
    from engine.checkpoint.plan import ResumePlan
    from engine.trainer.data import PromptStream
    from engine.trainer.worker_group import WorkerGroup


def carry_out(plan: ResumePlan, workers: WorkerGroup, stream: PromptStream) -> int:
    """Load every rank, restore the data position, drop metric rows after the step. Returns the
    step training continues after; ``plan.loaded``, ``plan.warnings`` and ``plan.rows_restored``
    record what happened."""
    plan.raise_if_refused()
    refusal = prompt_set_refusal(plan.data, stream.state_dict())
    if refusal:
        raise CheckpointError(refusal, title="cannot resume")
    plan.loaded = workers.load(plan.step_dir, {"allow_partial": plan.allow_partial, "step": plan.step})
    plan.warnings += backfill_warnings(plan.optimizer, plan.allow_partial, plan.loaded)
    stream.load_state_dict(plan.data)
    rewrite_run_dir(plan)
    return plan.step


def rewrite_run_dir(plan: ResumePlan) -> None:
    """Newer checkpoints (an explicit older step) set aside as .superseded-<name>-<time>, rows
    after the step and torn rows dropped, rows the checkpoint carries put back, and the plan
    appended to resumes.jsonl."""
    from engine.user_paths import append_to_run_file

    root = Path(plan.run_dir)
    stamp = int(time.time())
    for name in plan.later_checkpoints:  # an explicit older step: the abandoned future is set aside
        src = root / name
        if src.exists():
            os.replace(src, root / f".superseded-{name}-{stamp}")
    plan.rows_restored = repair_row_files(root, Path(plan.step_dir), plan.step)
    append_to_run_file(root / RESUME_LOG, (json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                                                      | plan.to_json(), default=str) + "\n").encode())
