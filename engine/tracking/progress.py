"""Long phases as events: ``PhaseStarted``, ``PhaseProgress`` (bytes so far, polled from disk
by a small thread while the phase runs) and ``PhaseFinished``. The CLI draws them; the engine
only emits."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from engine.events import PhaseFinished, PhaseProgress, PhaseStarted


def tree_bytes(*paths: Path) -> int:
    """Bytes of the files under each existing path (files may vanish while we walk)."""
    total = 0
    for p in paths:
        p = Path(p)
        if p.is_file():
            try:
                total += p.stat().st_size
            except OSError:
                pass
            continue
        for root, _dirs, files in os.walk(p):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:
                    pass
    return total


class PhaseResult:
    bytes: int | None = None


@contextmanager
def phase(emit: Callable[[object], None], name: str, label: str, *, total_bytes: int | None = None,
          step: int | None = None, poll: Callable[[], int] | None = None, interval_s: float = 0.25):
    """Emit start/progress/finish events around a long phase; set ``result.bytes`` to report a size.
    A phase whose body raises (an error, KeyboardInterrupt) gets no PhaseFinished."""
    emit(PhaseStarted(name, label, total_bytes, step))
    result = PhaseResult()
    stop = threading.Event()
    poller = None
    if poll is not None:
        def run():
            while not stop.wait(interval_s):
                emit(PhaseProgress(name, poll()))
        poller = threading.Thread(target=run, name=f"rl-progress-{name}", daemon=True)
        poller.start()
    t0 = time.perf_counter()
    finished = False
    try:
        yield result
        finished = True
    finally:
        stop.set()
        if poller is not None:
            poller.join()
        # only a phase that completed is reported finished: a save cut short by Ctrl-C or an error
        # was shown as "saved: step_N" while step_N did not exist (only .tmp-step_N)
        if finished:
            if result.bytes is None and poll is not None:
                result.bytes = poll()
            emit(PhaseFinished(name, label, time.perf_counter() - t0, result.bytes, step))
