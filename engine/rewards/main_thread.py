"""User code that only runs on a process's main thread, and the driver threads rl calls it from.

Python lets only a process's main thread set a signal handler, so a ``signal.alarm`` timeout
inside a reward function, a tool or an environment (some graders and code sandboxes use one)
raises ``ValueError: signal only works in main thread`` anywhere else. rl calls such code off the
main thread in these cases, and the same call in a script on its main thread would not fail, so
the error names where rl called it, why, and the fix:

- ``task.reward_timeout_s`` with ``task.reward_workers=0``: each call on a watched thread;
- ``trainer.mode=one_step_off|async``: batches scored on ``rl-score-ahead``, the agent loop (tools
  and environments) on ``rl-episodes``;
- ``trainer.stream_groups``: prompt groups scored on ``rl-score-stream``.

In the process pool (``task.reward_workers>=1``) every call runs on a worker's main thread.
"""

from __future__ import annotations

import threading

# why rl calls user code on a driver thread of this name (ThreadPoolExecutor prefixes)
DRIVER_THREADS = {"rl-score-ahead": "trainer.mode=one_step_off|async scores each batch as it arrives",
                  "rl-score-stream": "trainer.stream_groups scores each prompt group as it ends",
                  "rl-episodes": "trainer.mode=one_step_off|async runs the agent loop beside the update"}


def needs_main_thread(error: str) -> bool:
    """Whether a call's error is Python refusing a signal handler off the main thread."""
    return "signal only works in main thread" in error


def where_called(watched: bool) -> str:
    """Where the current call runs, for a message: "" on the main thread, unwatched."""
    thread = threading.current_thread()
    if watched:
        return "on a thread that times it out (task.reward_timeout_s)"
    if thread is threading.main_thread():
        return ""
    why = next((w for prefix, w in DRIVER_THREADS.items() if thread.name.startswith(prefix)), "")
    return f"on the driver thread `{thread.name}`" + (f" ({why})" if why else "")


def off_main_thread_fix(error: str, watched: bool) -> str:
    """The fix for a reward function or tool that failed only because it set a signal handler off
    the main thread; "" for any other failure (or on the main thread)."""
    where = where_called(watched) if needs_main_thread(error) else ""
    if not where:
        return ""
    return (f"It sets a signal handler, which Python allows only on a process's main thread, and rl called it "
            f"{where}. Set task.reward_workers=N to run it on worker processes' main threads (task.reward_timeout_s "
            f"still bounds each call), or time it out without signals")
