"""Driving `rl` from tests: in-process (typer's CliRunner, fast) or as a real subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def flat(text: str) -> str:
    """Rich panel text as one line: box characters dropped, whitespace collapsed."""
    return " ".join(re.sub(r"[│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻]", " ", text).split())


def cli(*args: str):
    """`rl ARGS` in this process. Returns click's Result (exit_code, stdout, stderr, exception)."""
    from typer.testing import CliRunner

    from rlcli.main import app

    return CliRunner().invoke(app, list(args))


def rl(*args: str, cwd=None, timeout: float = 600, env: dict | None = None, pre: str = ""):
    """`rl ARGS` as a subprocess using this tree. ``pre``: Python run before the CLI starts
    (e.g. hide a package with ``sys.modules['megatron'] = None``)."""
    code = f"import sys\n{pre}\nfrom rlcli.main import main\nsys.argv = ['rl'] + sys.argv[1:]\nmain()\n"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=full_env)
