"""Where a vLLM engine's ZeroMQ sockets live: a directory of rl's, removed with the engine.

vLLM names every socket between its processes ``ipc://$VLLM_RPC_BASE_PATH/<uuid4>``, by default
in the system temp directory, and its engine processes end without unlinking them: each
``rl train rollout=vllm`` left about seven socket files in /tmp, forever, on every host it ran
on. Here each engine gets its own directory (``rl-vllm-ipc-<pid>-*`` in the temp directory),
removed when the engine shuts down. A process killed before that (SIGKILL, the OOM killer)
leaves its directory; the next engine started on the host removes those whose process is gone.

A ``VLLM_RPC_BASE_PATH`` the user set is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "rl-vllm-ipc-"
#: a directory whose process is gone is removed only when older than this: a process in
#: another PID namespace sharing the temp directory looks gone, and an engine only binds its
#: sockets while it starts
STALE_AFTER_S = 600.0
#: AF_UNIX paths hold 107 bytes; vLLM appends "/" and a 36-character uuid
_MAX_DIR_LEN = 107 - 37


class IpcDir:
    """The socket directory of one vLLM engine: ``open()`` before starting it, ``remove()``
    after it has shut down. ``path`` is None where the user's ``VLLM_RPC_BASE_PATH`` applies
    (or the temp directory's path is too long for a socket)."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def open(self) -> None:
        current = os.environ.get(ENV)
        if current and not Path(current).name.startswith(PREFIX):
            return  # the user's
        tmp = tempfile.gettempdir()
        remove_stale(Path(tmp))
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmp))
        if len(str(path)) > _MAX_DIR_LEN:
            path.rmdir()
            os.environ.pop(ENV, None)  # vLLM's default, as long as the temp directory's
            return
        self.path = path
        os.environ[ENV] = str(path)  # read while the engine starts, by it and its processes

    def remove(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def remove_stale(tmp: Path, now: float | None = None) -> list[Path]:
    """Remove the socket directories in ``tmp`` of processes that no longer run (and older than
    STALE_AFTER_S). Returns those removed."""
    now = time.time() if now is None else now
    removed = []
    for d in tmp.glob(f"{PREFIX}*"):
        try:
            pid = int(d.name[len(PREFIX):].split("-", 1)[0])
            st = d.stat()
        except (ValueError, OSError):
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < STALE_AFTER_S or _alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
