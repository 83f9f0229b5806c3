"""Tools for tests/test_agents_tool_pool.py, in a module the reward pool's spawned workers import."""

from __future__ import annotations

import os
import time
from pathlib import Path


def slow(seconds: str) -> str:
    """Sleeps, then answers.

    Args:
        seconds: how long to sleep
    """
    time.sleep(float(seconds))
    return "awake"


def die(code: str) -> str:
    """Ends its own process at once, as a crash in native code would.

    Args:
        code: the exit code
    """
    os._exit(int(code))


def meet(spec: str) -> str:
    """Writes its own file, then waits (at most 8 s) for the other's: 'met' when both ran at once.

    Args:
        spec: directory|own name|other's name
    """
    folder, me, other = spec.split("|")
    Path(folder, me).write_text("here")
    deadline = time.monotonic() + 8.0
    while time.monotonic() < deadline:
        if Path(folder, other).exists():
            return "met"
        time.sleep(0.02)
    return "alone"


def add(expr: str) -> str:
    """Adds two numbers.

    Args:
        expr: a+b
    """
    a, b = expr.split("+")
    return str(int(a) + int(b))


def alarmed(expr: str) -> str:
    """Adds two numbers under a signal.alarm timeout, as code sandboxes often time calls out.

    Args:
        expr: "a+b"
    """
    import signal

    old = signal.signal(signal.SIGALRM, lambda *a: None)
    signal.alarm(5)
    try:
        a, b = expr.split("+")
        return str(int(a) + int(b))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
