"""rl's vLLM plugin (entry point ``vllm.general_plugins``: vLLM loads it in each of its processes).

It acts only in the processes of the engines rl starts: ``set_vllm_env`` sets ``RL_VLLM_ENGINE``
to the starting process's pid, which vLLM's processes inherit, and the plugin acts where the pid
differs (vLLM also loads plugins in the process that creates the engine: rl's own, left alone).
Any other vLLM on the machine loads it and nothing happens.

What it does: freezes the garbage collector's objects when the process exits. Each of vLLM's
processes (on CPU an engine core and a worker, spawned, so they end through the interpreter's full
shutdown) holds the ~500k long-lived objects of torch, transformers and vLLM, and the shutdown's
final collection walks them all: 2.4 s of CPU for a process that only imported them (measured on
this 2-core machine; 0.2 s after ``gc.freeze()``). vLLM stops an engine by SIGTERM and kills what
has not exited 5 s later, so every engine shutdown took those 5 s; with the collection skipped its
processes exit on their own. Freezing at exit changes nothing a process computed: frozen objects are
still freed by reference counting, only not walked by the collector."""

from __future__ import annotations

import atexit
import gc
import os

ENV = "RL_VLLM_ENGINE"


def register() -> None:
    """The plugin's entry point; vLLM may call it more than once in a process."""
    global _registered
    starter = os.environ.get(ENV, "")
    if starter.isdigit() and int(starter) != os.getpid() and not _registered:
        atexit.register(gc.freeze)
        _registered = True


_registered = False
