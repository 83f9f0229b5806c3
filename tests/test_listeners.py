"""A local run listens on loopback only, and its Ray processes end with it even when only the
`rl` process is SIGKILLed (issue 19, findings 5 and 8).

One real 2-rank `rl train` on its own private Ray (not the session's head, tests/conftest.py)
is started for the module; the tests look at it while it trains
(after its first metrics row is on disk), then kill it."""

from __future__ import annotations

import signal
import subprocess

import psutil
import pytest

from tests.ray_procs import alive, child_env, descendants, is_loopback, kill_all, metrics_rows, rl_cmd, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def running_train(tmp_path_factory):
    d = tmp_path_factory.mktemp("listen") / "ckpt"
    proc = subprocess.Popen(rl_cmd("train", "trainer.nprocs=2", "trainer.total_steps=1000", "data.train_batch_size=4",
                                   "algorithm.rollout_n=2", "checkpoint.save_freq=0", f"checkpoint.dir={d}"),
                            env=child_env(RAY_ADDRESS=None), stdout=open(d.parent / "train.log", "w"), stderr=subprocess.STDOUT,
                            text=True)  # a file, not an unread pipe: 1000 steps of rows would fill a pipe
    seen: list[psutil.Process] = []
    try:
        wait_for(lambda: metrics_rows(d), 300, "the first step's metrics row", proc)
        yield proc, d, seen
    finally:
        seen.extend(descendants(proc.pid))
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        kill_all(seen)


def test_local_run_listens_on_loopback_only(running_train):
    """Every TCP socket in LISTEN state held by the driver or any process under it (Ray's GCS,
    raylet, agents, the rank workers with their torch.distributed store and gloo pairs) is
    bound to 127.0.0.0/8 or ::1. The TCP store of `init_method=tcp://127.0.0.1:P` listened on
    `*:P`; it now listens on a socket bound to rank 0's node address."""
    proc, _, seen = running_train
    procs = [psutil.Process(proc.pid)] + descendants(proc.pid)
    seen.extend(procs[1:])
    ranks = [p for p in procs if p.name().startswith("ray::RankWorker")]
    assert len(ranks) == 2, [p.name() for p in procs]
    listeners, bad = [], []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                listeners.append((p.name(), c.laddr.ip, c.laddr.port))
                if not is_loopback(c.laddr.ip):
                    bad.append((p.pid, p.name(), c.laddr.ip, c.laddr.port))
    assert any(name.startswith("ray::RankWorker") for name, _, _ in listeners), listeners
    assert not bad, f"listeners not on loopback: {bad}"


def test_sigkill_of_rl_leaves_no_ray_process(running_train):
    """SIGKILL to the `rl` process alone: within a bounded wait, none of the processes it had
    started (GCS, raylet, dashboard and runtime-env agents, workers) is left running."""
    proc, _, seen = running_train
    before = descendants(proc.pid)
    seen.extend(before)
    names = sorted({p.name() for p in before})
    assert any("raylet" in n for n in names) and any(n.startswith("ray::") for n in names), names
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    try:
        wait_for(lambda: not alive(before), 90, "the run's Ray processes to end")
    except AssertionError:
        left = [(p.pid, p.name()) for p in alive(before)]
        raise AssertionError(f"left running after SIGKILL of rl: {left}") from None
