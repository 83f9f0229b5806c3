"""`rl` leaves without the interpreter's teardown after a heavy command (rlcli/fast_exit.py),
but everything a normal exit does for the program still happens: the exit status, atexit
handlers, non-daemon threads finishing, buffered output reaching the pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.fast_exit import exit_code

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r"""
import atexit, sys, threading, time
import torch  # a heavy command: the fast path
from rlcli.fast_exit import leave

out = sys.argv[1]
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
def late():
    time.sleep(0.3)
    open(out + ".thread", "w").write("done")
threading.Thread(target=late).start()   # non-daemon: a normal exit waits for it
sys.stdout.write("x" * 100000)          # buffered: must reach the pipe
leave(int(sys.argv[2]) if sys.argv[2] != "msg" else "a message")
"""


@pytest.mark.parametrize("code", ["0", "3", "msg"])
def test_fast_exit_keeps_status_atexit_threads_and_output(tmp_path, code):
    out = tmp_path / "f"
    r = subprocess.run([sys.executable, "-c", PROGRAM, str(out), code], capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == (1 if code == "msg" else int(code)), r.stderr[-2000:]
    assert r.stdout == "x" * 100000
    assert (tmp_path / "f.atexit").read_text() == "ran"
    assert (tmp_path / "f.thread").read_text() == "done"
    if code == "msg":
        assert "a message" in r.stderr


def test_exit_code_is_what_sys_exit_gives():
    assert exit_code(None) == 0 and exit_code(0) == 0 and exit_code(2) == 2
    assert exit_code("boom") == 1
