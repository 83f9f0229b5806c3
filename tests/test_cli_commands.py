"""Every command module the CLI lists is registered, and a missing one fails the CLI loudly
instead of silently dropping the command (a deleted command must fail tests, not skip them)."""

from __future__ import annotations

import subprocess
import sys

from rlcli.main import COMMAND_MODULES, app


def test_every_command_module_registers_its_command():
    names = {c.name for c in app.registered_commands}
    assert {m.replace("_", "-") for m in COMMAND_MODULES} <= names, names


def test_a_missing_command_module_fails_the_cli():
    code = ("import sys; sys.modules['rlcli.commands.env'] = None\n"
            "import rlcli.main")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "rlcli.commands.env" in r.stderr
