"""Driving `rl` from tests: in-process (typer's CliRunner, fast) or as a real subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# the suite's shared small run (the `small_run` fixture, tests/conftest.py): 2 steps of the default
# job, 4 prompts x 2 samples, every row trained
SMALL_RUN = ["trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=2",
             "engine.skip_zero_advantage_rows=false"]


def flat(text: str) -> str:
    """Rich panel text as one line: box characters dropped, whitespace collapsed."""
    return " ".join(re.sub(r"[│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻]", " ", text).split())


def cli(*args: str):
    """`rl ARGS` in this process. Returns click's Result (exit_code, stdout, stderr, exception)."""
    from typer.testing import CliRunner

    from rlcli.main import app

    return CliRunner().invoke(app, list(args))


def _rl_argv(args, pre: str) -> list[str]:
    code = f"import sys\n{pre}\nfrom rlcli.main import main\nsys.argv = ['rl'] + sys.argv[1:]\nmain()\n"
    return [sys.executable, "-c", code, *args]


def _rl_env(env: dict | None) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}


def rl(*args: str, cwd=None, timeout: float = 600, env: dict | None = None, pre: str = ""):
    """`rl ARGS` as a subprocess using this tree. ``pre``: Python run before the CLI starts
    (e.g. hide a package with ``sys.modules['megatron'] = None``)."""
    return subprocess.run(_rl_argv(args, pre), capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=_rl_env(env))


def rl_concurrently(*calls: Sequence[str], cwd=None, timeout: float = 600, env: dict | None = None,
                    pre: str = "") -> list[subprocess.CompletedProcess]:
    """`rl ARGS` for each ARGS in ``calls``, all started at once (command and environment as
    `rl` builds them), for runs that are independent of each other: they must not share a run
    directory, a port or any file they write. One run keeps about one core busy, so on CI's 2
    cores two runs together take little more than the longer one. Returns one CompletedProcess
    per call, in order. When any is still running after ``timeout`` seconds (from the start),
    or the wait is interrupted, all of them are killed; a timeout raises TimeoutExpired as
    subprocess.run does."""
    procs: list[tuple[subprocess.Popen, object, object]] = []
    try:
        for args in calls:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill up
            procs.append((subprocess.Popen(_rl_argv(args, pre), stdout=out, stderr=err, cwd=cwd,
                                           env=_rl_env(env)), out, err))
        deadline = time.monotonic() + timeout
        results = []
        for p, out, err in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q, _, _ in procs:
                    q.kill()
                p.wait()
                out.seek(0)
                err.seek(0)
                raise subprocess.TimeoutExpired(p.args, timeout, output=out.read(), stderr=err.read()) from None
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        return results
    finally:
        for p, out, err in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            out.close()
            err.close()
