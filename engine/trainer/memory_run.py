"""`rl mem-report` without a run directory: run ONE RL step of a job through the real trainer
in a temporary directory, then report what the memory tracker recorded (engine/memory/measure.py
reads it). It lives with the trainer because it runs it; engine/memory never imports the trainer."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional, Union

from engine.memory.measure import (ONE_STEP_OVERRIDES, MemoryReportWithNotes, _check_not_reserved,
                                   device_memory_bytes, report_from_run)


def measure_default(overrides: Optional[list[str]] = None, engine: Optional[str] = None,
                    device_memory: Union[None, int, str] = None,
                    on_event: Callable[[object], None] = lambda e: None) -> MemoryReportWithNotes:
    """Run ONE RL step of the job (default: the embedded default) through the real trainer in
    a temporary run directory (nothing saved), then report what it recorded."""
    from engine.config.load import load_run_config
    from engine.trainer.trainer import train

    overrides = list(overrides or [])
    dev = device_memory_bytes(device_memory)
    _check_not_reserved(overrides)
    tmp = Path(tempfile.mkdtemp(prefix="rl-mem-report-"))
    try:
        loaded = load_run_config(overrides + list(ONE_STEP_OVERRIDES) + [f"checkpoint.dir={tmp}"], engine=engine)
        train(loaded.config, tmp, overrides=loaded.overrides, changed=loaded.changed, on_event=on_event)
        rep = report_from_run(tmp, dev)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    what = "the default job" if not overrides else " ".join(overrides)
    rep.source = f"one step of {what}" + (f" (--engine {engine})" if engine else "")
    rep.run_dir = None
    rep.notes.insert(0, f"ran 1 step in a temporary directory ({', '.join(ONE_STEP_OVERRIDES)}), now deleted")
    return rep
