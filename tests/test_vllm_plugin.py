"""rl's vLLM plugin (engine/rollout/vllm_plugin.py): registered as a `vllm.general_plugins` entry
point; in a process started under RL_VLLM_ENGINE=<pid of the process that starts the engine>
(vLLM's engine processes) the garbage collector's objects are frozen at exit, after the handlers
registered later have run; in the starting process itself (vLLM loads plugins there too) and
anywhere else (any other vLLM on the machine) it does nothing. Its effect on a real engine,
exiting within vLLM's deadline, is checked in tests/test_vllm.py."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

# a handler registered before the plugin runs after it: it sees the freeze
_CHILD = """
import atexit, gc, os
if os.environ["RL_VLLM_ENGINE"] == "self":
    os.environ["RL_VLLM_ENGINE"] = str(os.getpid())  # the process that starts the engine
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
from engine.rollout.vllm_plugin import register
import atexit as a
before = a._ncallbacks()
register(); register()  # vLLM may load plugins more than once in a process
print("handlers added:", a._ncallbacks() - before, flush=True)
"""


def test_the_entry_point_names_the_plugin():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rl_exit_without_gc"]
    from engine.rollout.vllm_plugin import register

    assert ep.load() is register


@pytest.mark.parametrize("env,added,frozen", [("parent", 1, True), ("self", 0, False), ("", 0, False)])
def test_only_rls_engines_freeze_at_exit(env, added, frozen):
    import os

    value = str(os.getpid()) if env == "parent" else env  # parent: a process that rl's rank started
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "RL_VLLM_ENGINE": value})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"handlers added: {added}", f"frozen at exit: {frozen}"], r.stdout
