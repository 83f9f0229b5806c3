"""Where a vLLM engine's ZeroMQ sockets live: a directory of rl's, removed with the engine.

vLLM names every socket between its processes ``ipc://$VLLM_RPC_BASE_PATH/<uuid4>``, by default
in the system temp directory, and its engine processes end without unlinking them: each
``rl train rollout=vllm`` left about seven socket files in /tmp, forever, on every host it ran
on. Here each engine gets its own directory (``rl-vllm-ipc-*`` in the temp directory), removed
when the engine shuts down; one left by a killed process is removed by the next engine started
on the host (engine/owned_dirs.py).

A ``VLLM_RPC_BASE_PATH`` the user set is left alone.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from engine.owned_dirs import OwnedDir

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "rl-vllm-ipc-"
#: AF_UNIX paths hold 107 bytes; vLLM appends "/" and a 36-character uuid, mkdtemp 8 characters
_MAX_BASE_LEN = 107 - 37 - len(PREFIX) - 8 - 1


class IpcDir:
    """The socket directory of one vLLM engine: ``open()`` just before starting it, ``remove()``
    after it has shut down. ``path`` is None where the user's ``VLLM_RPC_BASE_PATH`` applies, or
    where the temp directory's path is too long for a socket under it (vLLM's default then)."""

    def __init__(self) -> None:
        self._dir: OwnedDir | None = None
        self._before: str | None = None  # the variable's value before open(), restored by remove()

    @property
    def path(self) -> Path | None:
        return self._dir.path if self._dir is not None else None

    def open(self) -> None:
        current = os.environ.get(ENV)
        if current and not Path(current).name.startswith(PREFIX):
            return  # the user's
        tmp = tempfile.gettempdir()
        if len(tmp) > _MAX_BASE_LEN:
            os.environ.pop(ENV, None)
            return
        self._before = current if current and Path(current).is_dir() else None  # another engine's, still up
        self._dir = OwnedDir(PREFIX, tmp)
        os.environ[ENV] = str(self._dir.path)  # read while the engine starts, by it and its processes

    def remove(self) -> None:
        """Remove the directory, and put the variable back: a vLLM started later by this process
        or a child it spawns must not be pointed at a directory that is gone."""
        d, self._dir = self._dir, None
        if d is None:
            return
        if os.environ.get(ENV) == str(d.path):
            if self._before is not None and Path(self._before).is_dir():
                os.environ[ENV] = self._before
            else:
                os.environ.pop(ENV, None)
        d.remove()
