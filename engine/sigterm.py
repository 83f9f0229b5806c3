"""SIGTERM (``kill``, ``timeout``, a job scheduler stopping the job) as ``SystemExit(143)`` while a
block runs, so its ``finally`` blocks and context exits run as on Ctrl-C.

Python's default for SIGTERM ends the process at once, without cleanup: a half-written export
staging directory was left behind, and during a run Ray's own handler (installed by ``ray.init``)
printed a stack dump and exited 15 with the workers still up. Only the main thread can set a
signal handler; elsewhere the block runs unchanged.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

TERMINATED_EXIT = 128 + signal.SIGTERM  # 143, the shell's code for a process ended by SIGTERM


_received = threading.Event()
_depth = [0]  # sigterm_as_exit blocks entered on the main thread and not yet left


def _on_sigterm(signum, frame):
    if _received.is_set():  # a second SIGTERM while the first stop unwinds: let the cleanup finish
        return
    _received.set()
    raise SystemExit(TERMINATED_EXIT)


def received() -> bool:
    """Whether a SIGTERM has arrived inside the latest ``sigterm_as_exit`` block of this process:
    the stop under way is a kill, and whatever else the kill reached (with the run's whole process
    group, the private Ray's own processes) may be going down too. Cleared when an outermost block
    starts (a process that runs several commands, as the tests do, starts each one unkilled)."""
    return _received.is_set()


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143); the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth[0] == 0:
        _received.clear()  # the outermost block: a new command, not killed yet
    _depth[0] += 1
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        _depth[0] -= 1
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
