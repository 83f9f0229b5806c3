"""One writer per run directory (issue 19, finding 2 / required 3): `rl train` and `rl resume`
hold an exclusive lock for the whole run; a second writer gets exit 2 naming the holder; a lock
left by a dead process is taken over with a note."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.trainer.run_lock import LOCK_FILE, RunLock, RunLocked
from tests.cli_utils import ROOT, flat, rl

HOLD = """
import sys
import time
from pathlib import Path
from engine.trainer.run_lock import RunLock
lock = RunLock(Path(sys.argv[1]), command="holder").acquire()
print("locked", flush=True)
sys.stdin.readline()   # hold until the test closes stdin
lock.release()
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "locked"   # the event: the other process holds the lock
    return p


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunLocked) as e:
            RunLock(tmp_path / "run").acquire()
        msg = e.value.message
        assert f"pid {holder.pid}" in msg and socket.gethostname() in msg and "since 20" in msg and "holder" in msg
        assert e.value.exit_code == 2
        assert RunLock.held_by_other(tmp_path / "run")["pid"] == holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # released: the file is gone and the next writer gets the lock without a note
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    lock = RunLock(tmp_path / "run").acquire()
    assert lock.note == ""
    lock.release()


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = _dead_pid()
    (run / LOCK_FILE).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "command": "rl train",
                                             "started": "2026-01-01T00:00:00Z"}))
    assert RunLock.held_by_other(run) is None
    with RunLock(run) as lock:
        assert f"pid {dead}" in lock.note and "no longer running" in lock.note
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (run / LOCK_FILE).exists()


@pytest.mark.slow
def test_two_real_writers_one_is_refused_and_no_step_is_logged_twice(tmp_path):
    """Two `rl resume ckpt/` (and an `rl train` into the same dir) while one runs: the others
    exit 2 naming the running one; metrics.jsonl holds each step once. A stale lock left by a
    dead process is taken over with a note."""
    d = tmp_path / "ckpt"
    common = ["data.train_batch_size=4", "algorithm.rollout_n=4"]
    r = rl("train", "trainer.total_steps=2", f"checkpoint.dir={d}", *common, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (d / LOCK_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "command": "rl resume",
                                           "started": "2026-01-01T00:00:00Z"}))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "rlcli.main", "resume", str(d), "trainer.total_steps=14"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        # the event: the lock file names the first resume (it holds the lock until it exits)
        deadline = time.monotonic() + 600  # a hang guard, not a timing assertion
        while (RunLock.holder(d) or {}).get("pid") != first.pid and first.poll() is None:
            assert time.monotonic() < deadline, "the first resume never took the lock"
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1][-3000:]
        second = rl("resume", str(d), "trainer.total_steps=14", cwd=tmp_path)
        third = rl("train", f"checkpoint.dir={d}", "checkpoint.overwrite=true", cwd=tmp_path)
        out, err = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    assert "took over a stale lock" in flat(out)
    for other in (second, third):
        assert other.returncode == 2, other.stderr[-3000:]
        assert "Traceback" not in other.stderr
        text = flat(other.stderr)
        assert f"pid {first.pid}" in text and "in use by another rl run" in text, text
    steps = [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 15))
    assert (d / "step_14" / "manifest.json").exists() and not (d / LOCK_FILE).exists()
