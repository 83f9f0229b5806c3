"""Driving `rl` from tests: in-process (typer's CliRunner, fast) or as a real subprocess."""

from __future__ import annotations

import contextlib
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


# The commands that load torch (a run: a Ray job with its rank actors; mem-report's measured step;
# an export) run in the test process unless a test asks for a process of their own: the `rl`
# driver's imports (torch, Ray, transformers: ~2 of a 1-step run's ~8 CPU-s, docs/benchmarks.md
# "Test suite") are then paid once per test worker instead of once per command. The ranks are
# real Ray actors in their own processes either way. What a separate driver process adds (its
# exit path, its environment, signals, being killed) is what the tests that pass ``env``/``pre``
# or ``own_process=True`` test. `RL_TEST_SUBPROCESS=1` runs every command as a subprocess.
IN_PROCESS = ("train", "resume", "mem-report", "export")


def rl(*args: str, cwd=None, timeout: float = 600, env: dict | None = None, pre: str = "",
       own_process: bool = False):
    """`rl ARGS` using this tree: a run (``IN_PROCESS``) in this process, anything else, or any
    call with ``env``, ``pre`` (Python run before the CLI starts, e.g. hide a package with
    ``sys.modules['megatron'] = None``) or ``own_process=True``, as a subprocess. Returns a
    CompletedProcess either way; an in-process exception that `rl` would have printed as a
    traceback is in its stderr, with exit status 1, as a subprocess would show it."""
    if not own_process and _in_process(args, env, pre):
        return rl_in_process(*args, cwd=cwd, env=env)
    return subprocess.run(_rl_argv(args, pre), capture_output=True, text=True, cwd=cwd, timeout=timeout,
                           env=_rl_env(env))


# environment variables a command reads when it runs (rich's console width and colour), so an
# in-process command can be given them
PER_COMMAND_VARS = ("COLUMNS", "NO_COLOR")


def _own_env(env: dict | None) -> dict:
    """The values of ``env`` that differ from this process's environment (PYTHONPATH=ROOT, which
    every `rl` here gets, does not count)."""
    return {k: v for k, v in (env or {}).items()
            if os.environ.get(k) != v and not (k == "PYTHONPATH" and v == str(ROOT))}


def _in_process(args: Sequence[str], env: dict | None, pre: str) -> bool:
    """Whether `rl ARGS` runs in this process: a run, with no Python to run first and no
    environment of its own beyond ``PER_COMMAND_VARS``."""
    return (bool(args) and args[0] in IN_PROCESS and not pre and set(_own_env(env)) <= set(PER_COMMAND_VARS)
            and os.environ.get("RL_TEST_SUBPROCESS") != "1")


@contextlib.contextmanager
def _as_its_own_process(cwd):
    """Run the body in ``cwd`` and then put back what a command may change for the rest of its
    process, so that the next in-process command and test start as a new `rl` process would: the
    working directory, the environment, sys.path, the SIGINT/SIGTERM handlers, and the modules it
    imported from outside the installed packages and this tree (a user's reward or tool file: a
    later run's file of the same name must be imported afresh)."""
    import signal
    import sysconfig

    before = (os.getcwd(), dict(os.environ), list(sys.path), set(sys.modules),
              {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    kept = tuple({sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {str(ROOT)})
    try:
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        where, env, path, modules, handlers = before
        os.chdir(where)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None)
            if file and not os.path.abspath(file).startswith(kept):
                del sys.modules[name]
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def rl_in_process(*args: str, cwd=None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rl ARGS` through the Typer app in this process, in ``cwd``, with ``env``'s
    ``PER_COMMAND_VARS`` set while it runs: exit status, stdout and stderr as the `rl` process
    gives them (rlcli/main.py adds only the fast exit around the app)."""
    import traceback

    from typer.testing import CliRunner

    from rlcli.main import app

    with _as_its_own_process(cwd):
        r = CliRunner().invoke(app, list(args), env=_own_env(env))
    err = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        err += "".join(traceback.format_exception(r.exception))
    return subprocess.CompletedProcess(["rl", *args], r.exit_code, r.stdout, err)


def rl_concurrently(*calls: Sequence[str], cwd=None, timeout: float = 600, env: dict | None = None,
                    pre: str = "") -> list[subprocess.CompletedProcess]:
    """`rl ARGS` for each ARGS in ``calls``, all started at once (command and environment as
    `rl` builds them), for runs that are independent of each other: they must not share a run
    directory, a port or any file they write. One run keeps about one core busy, so on CI's 2
    cores two runs together take little more than the longer one. Returns one CompletedProcess
    per call, in order. When any is still running after ``timeout`` seconds (from the start),
    or the wait is interrupted, all of them are killed; a timeout raises TimeoutExpired as
    subprocess.run does. When the first call would run in this process (see ``rl``), it runs
    there while the others run as processes (the timeout does not cover it)."""
    here = _in_process(calls[0], env, pre) if calls else False
    procs: list[tuple[subprocess.Popen, object, object]] = []
    try:
        for args in calls[1:] if here else calls:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill up
            procs.append((subprocess.Popen(_rl_argv(args, pre), stdout=out, stderr=err, cwd=cwd,
                                           env=_rl_env(env)), out, err))
        deadline = time.monotonic() + timeout
        results = [rl_in_process(*calls[0], cwd=cwd, env=env)] if here else []
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
