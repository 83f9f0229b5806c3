"""One writer per run directory: an exclusive lock held by `rl train` / `rl resume` for the
whole run.

    with RunLock(Path("ckpt"), command="rl resume ckpt/") as lock:
        ...                         # lock.note: "took over a stale lock of pid 123 (...)"

The lock is ``fcntl.flock`` on ``<run dir>/run.lock``; the file holds who holds it (pid, host,
command, start time) so a refused second writer can name the holder. The kernel drops a flock
when its holder dies, however it dies, so a lock file left by a killed run is taken over (with
a note naming the dead holder). The file is removed on release; a holder re-checks after
locking that the path still names the file it locked, so a release racing a new lock cannot
leave two holders. On NFS, Linux emulates flock with POSIX byte-range locks, which the server
arbitrates between hosts.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from engine import json_safe
from engine.errors import UserError

LOCK_FILE = "run.lock"


class RunLocked(UserError):
    """Another process is writing this run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, ValueError):
        return False
    return True


def _describe(holder: dict) -> str:
    since = holder.get("started", "?")
    cmd = holder.get("command") or "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {since} (`{cmd}`)"


class RunLock:
    def __init__(self, run_dir: Path, command: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.command = command if command is not None else " ".join(["rl", *sys.argv[1:]])[:500]
        self.note = ""              # set when a stale lock was taken over
        self.created_dir = False    # the run directory did not exist before the lock
        self._fd: int | None = None

    # -- reading
    @staticmethod
    def holder(run_dir: Path) -> dict | None:
        """Who the lock file says holds (or last held) ``run_dir``; None without a readable file."""
        try:
            data = json_safe.loads((Path(run_dir) / LOCK_FILE).read_text() or "null")
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @staticmethod
    def locked_message(run_dir: Path, holder: dict) -> str:
        return (f"{run_dir}/ is in use by another rl run: {_describe(holder)}. A run directory has one writer. "
                f"Wait for that run to finish (or stop it), or use another checkpoint.dir.")

    @staticmethod
    def held_by_other(run_dir: Path) -> dict | None:
        """The holder, if another process holds the lock now (checked without taking it)."""
        try:
            fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return RunLock.holder(run_dir) or {}
        except OSError:
            return None
        finally:
            os.close(fd)  # closing drops a lock we may just have taken
        return None

    # -- taking and releasing
    def acquire(self) -> "RunLock":
        try:
            return self._acquire()
        except OSError as e:
            from engine.trainer.io_errors import describe_os_error

            raise UserError(f"Cannot lock the run directory {self.run_dir}/: {describe_os_error(e)}. Choose a "
                            f"writable checkpoint.dir.", title="run directory unusable") from None

    def _acquire(self) -> "RunLock":
        self.created_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(50):  # retried only when a release races us (the file was unlinked)
            # read-only: a file held open for writing would keep the file system from being
            # remounted read-only; the holder's details are written through a second, short-lived fd
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLocked(self.locked_message(self.run_dir, self.holder(self.run_dir) or {}),
                                title="run directory locked") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._fd = fd
            self._take_over_note()
            self._write_holder()
            return self
        raise RunLocked(f"{self.path} keeps being replaced while locking; another process is racing for it.",
                        title="run directory locked")

    def _take_over_note(self) -> None:
        old = self.holder(self.run_dir)
        if not old or old.get("pid") == os.getpid():
            return
        here = old.get("host") == socket.gethostname()
        pid = old.get("pid")
        state = ("no longer running" if isinstance(pid, int) and not _pid_alive(pid) else "not holding it")
        where = "" if here else " (another host; its lock was released)"
        self.note = (f"took over a stale lock on {self.run_dir}/: {_describe(old)} is {state}{where}; "
                     f"it did not finish cleanly.")

    def _write_holder(self) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(self.path, "w") as f:  # the same file (inode checked in _acquire), truncated
            f.write(json.dumps(info))
            f.flush()
            os.fsync(f.fileno())

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # unlink while holding: see the module docstring
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
