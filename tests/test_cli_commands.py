"""Every command module the CLI lists is registered, and a missing one fails the CLI loudly
instead of silently dropping the command (a deleted command must fail tests, not skip them)."""

from __future__ import annotations

import subprocess
import sys
import tempfile

from rlcli.main import COMMAND_MODULES, app


def test_every_command_module_registers_its_command():
    names = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}  # `rl config show`
    assert {m.replace("_", "-") for m in COMMAND_MODULES} <= names, names


def test_a_missing_command_module_fails_the_cli():
    code = ("import sys; sys.modules['rlcli.commands.env'] = None\n"
            "import rlcli.main")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "rlcli.commands.env" in r.stderr


def test_output_width_follows_the_terminal_when_the_command_runs():
    """rich fixes a console's width from COLUMNS when the console is made. rl makes its
    consoles when a command runs, so a command drawn in a wide terminal is drawn wide even
    if rlcli was imported under a narrow one (an embedding program; pytest-xdist workers
    export COLUMNS=80): tables and error panels are not wrapped at a stale width.

    Measured on an error panel whose message (a path of over 400 characters) is wider than either
    terminal, so the panel is exactly as wide as the console: what a table holds (paths,
    versions, user names) differs by machine and may fit in 80 columns anywhere."""
    code = ("import os, sys, rlcli.output, rlcli.run_render\n"
            "os.environ['COLUMNS'] = sys.argv[1]\n"
            "from rlcli.main import app\n"
            "app(['inspect-ckpt', os.path.join(sys.argv[2], *['no-such-checkpoint'] * 22)])\n")
    widths = {}
    for cols in ("60", "200"):
        r = subprocess.run([sys.executable, "-c", code, cols, tempfile.gettempdir()], capture_output=True, text=True,
                           timeout=120, env={**__import__("os").environ, "COLUMNS": "80", "NO_COLOR": "1"})
        assert r.returncode == 2, r.stderr
        assert "no such checkpoint" in r.stderr, r.stderr
        widths[cols] = max(len(line) for line in r.stderr.splitlines())
    assert widths == {"60": 60, "200": 200}, widths
