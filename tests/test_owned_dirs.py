"""Temporary directories that end with their process (engine/owned_dirs.py): the vLLM rollout's
copy of the weights in /dev/shm and its socket directory. A process killed before it cleans up
(SIGKILL here, as the OOM killer does) leaves its directory; the next one made on the host
removes it. A live owner's directory, one too young to be sure its creator has locked it, one
without a lock file and another family are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from engine import owned_dirs
from engine.owned_dirs import LOCK, OwnedDir, remove_orphans

HOLD = ("import sys, time; from engine.owned_dirs import OwnedDir; d = OwnedDir(sys.argv[1], sys.argv[2]); "
        "(d.path / 'weights').write_bytes(b'x' * 1000); print(d.path, flush=True); time.sleep(600)")


def _holder(prefix: str, base) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, prefix, str(base)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    return p, p.stdout.readline().strip()


def _age(path: Path) -> None:
    old = time.time() - 2 * owned_dirs._SETTLE_S
    os.utime(path / LOCK, (old, old))


def test_a_killed_owners_directory_is_removed_by_the_next_and_a_live_ones_is_not(tmp_path):
    holders = {name: _holder(prefix, tmp_path) for name, prefix in
               (("killed", "rl-vllm-rank0-"), ("live", "rl-vllm-rank1-"), ("young", "rl-vllm-rank2-"),
                ("other", "other-"))}
    dirs = {name: Path(d) for name, (_, d) in holders.items()}
    try:
        for name in ("killed", "young", "other"):
            holders[name][0].kill()
            holders[name][0].wait()
        for name in ("killed", "live", "other"):
            _age(dirs[name])
        no_lock = tmp_path / "rl-vllm-rank9-nolock"
        no_lock.mkdir()

        mine = OwnedDir("rl-vllm-rank0-", str(tmp_path), family="rl-vllm-rank")
        assert not dirs["killed"].exists(), "the killed owner's directory is still there"
        for kept in (dirs["live"], dirs["young"], dirs["other"], no_lock, mine.path):
            assert kept.exists(), kept
        mine.remove()
        assert not mine.path.exists()

        holders["live"][0].kill()
        holders["live"][0].wait()
        assert remove_orphans(tmp_path, "rl-vllm-rank") == [dirs["live"]]
        _age(dirs["young"])
        assert remove_orphans(tmp_path, "rl-vllm-rank") == [dirs["young"]]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([no_lock.name, dirs["other"].name])
    finally:
        for p, _ in holders.values():
            if p.poll() is None:
                p.kill()


def test_on_a_file_system_without_locks_the_directory_works_and_is_never_taken_for_an_orphan(tmp_path,
                                                                                            monkeypatch):
    """flock can fail where the file system has no locks (some network mounts): the directory is
    still made, without a lock file, so no other process's sweep removes it while it is used."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    with monkeypatch.context() as m:
        m.setattr(fcntl, "flock", no_locks)
        d = OwnedDir("rl-eval-", str(tmp_path))
    assert d.path.is_dir() and not (d.path / LOCK).exists()
    os.utime(d.path, (0, 0))
    assert remove_orphans(tmp_path, "rl-eval-") == [] and d.path.is_dir()
    d.remove()
    assert not d.path.exists()
