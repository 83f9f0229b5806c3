"""Leave the `rl` process without the interpreter's final teardown.

After a command that loaded torch, transformers and Ray, Python's own exit spends ~0.9 s
freeing every module and object one by one (measured: a 1-step `rl train` printed its result
at 8.5-9.0 s and exited at 9.4-9.9 s; with this, 0.04 s after the result). Everything a normal
exit does for the program itself still runs, in the same order: threading's exit hooks
(concurrent.futures shuts its executors down there) and the join of non-daemon threads, then
every ``atexit`` handler (logging, multiprocessing, Ray, wandb/MLflow, weakref finalizers),
then flushed stdout/stderr. Only after a heavy command (torch imported); `rl --help` and
completion exit normally.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_code(code) -> int:
    """The status ``sys.exit(code)`` gives: None -> 0, an int as is, anything else printed to
    stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def leave(code) -> None:
    """Exit with ``code`` (what SystemExit carried): fast when torch was loaded, else normally."""
    status = exit_code(code)
    shutdown_threads = getattr(threading, "_shutdown", None)
    if "torch" not in sys.modules or shutdown_threads is None:
        sys.exit(status)
    shutdown_threads()          # threading's exit hooks, then join non-daemon threads
    atexit._run_exitfuncs()     # every atexit handler, last registered first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    os._exit(status)
