"""Which Ray a run uses when another Ray cluster runs on the machine (issue 19, finding 7).

The cluster is a real `ray start --head` on 127.0.0.1 with its own RAY_TMPDIR, so that its
/tmp/ray/ray_current_cluster record (the file that made every later `rl train` try to join
it) is private to these tests; the `rl train` subprocesses get the same RAY_TMPDIR. It is
the session's head (tests/conftest.py, which is exactly such a head; starting a second one
here cost ~7-13 s), or, under RL_TEST_PRIVATE_RAY=1 (no session head), one started for the
module, whose teardown ends exactly that cluster's processes (not `ray stop`, which would end
every Ray on the machine)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from engine.trainer.ray_cluster import RayTarget, resolve_address
from tests.ray_procs import LoopbackHead, child_env, rl_cmd

TINY = ("trainer.total_steps=1", "data.train_batch_size=2", "algorithm.rollout_n=2", "checkpoint.save_final=false")


def test_resolve_address_rules():
    """Empty config: RAY_ADDRESS if set, else a private local Ray; `local` forces the private
    one; an explicit address always wins."""
    assert resolve_address("", {}) == RayTarget("", "local")
    assert resolve_address("", {"RAY_ADDRESS": "10.0.0.1:6379"}) == RayTarget("10.0.0.1:6379", "RAY_ADDRESS")
    assert resolve_address("local", {"RAY_ADDRESS": "10.0.0.1:6379"}).local
    assert resolve_address("auto", {"RAY_ADDRESS": "x:1"}) == RayTarget("auto", "trainer.ray_address")
    assert resolve_address("ray://h:10001", {}).address == "ray://h:10001"
    assert RayTarget("", "local").loopback and RayTarget("127.0.0.1:6379", "x").loopback
    assert RayTarget("ray://localhost:10001", "x").loopback
    assert not RayTarget("10.231.0.1:6379", "x").loopback and not RayTarget("ray://h:10001", "x").loopback


def test_a_driver_joining_other_machines_leaves_their_hardware_checks_to_them():
    """A CPU-only head node drives GPU workers: the driver's own CUDA is not the ranks'. Local and
    loopback clusters are this machine, checked here; a cluster elsewhere is checked by its ranks
    (a rank without CUDA refuses trainer.device=cuda itself, naming its host)."""
    from engine.config.schema import RunConfig
    from engine.device import check_device_config
    from engine.errors import ConfigError
    from engine.trainer.ray_cluster import ranks_elsewhere

    assert not ranks_elsewhere("", {}) and not ranks_elsewhere("127.0.0.1:6379", {})
    assert not ranks_elsewhere("localhost:6379", {}) and not ranks_elsewhere("local", {"RAY_ADDRESS": "10.0.0.1:6379"})
    assert ranks_elsewhere("10.0.0.1:6379", {}) and ranks_elsewhere("", {"RAY_ADDRESS": "ray://head:10001"})
    cfg = RunConfig()
    cfg.trainer.device = "cuda"  # this machine has no GPU
    with pytest.raises(ConfigError, match="no CUDA device is visible on this machine"):
        check_device_config(cfg)
    check_device_config(cfg, ranks_elsewhere=True)


def test_local_only_setting_is_set_for_local_runs_and_removed_for_cluster_drivers(monkeypatch):
    """RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps a local Ray on loopback but makes `ray start
    --address` refuse to join: a joining driver must not carry it (nor an already-imported
    Ray's constant)."""
    import ray._private.ray_constants as rc

    from engine.trainer.ray_cluster import LOCAL_ONLY_VAR, _set_local_only

    monkeypatch.setattr(rc, "ENABLE_RAY_CLUSTER", rc.ENABLE_RAY_CLUSTER)
    monkeypatch.setenv(LOCAL_ONLY_VAR, "0")
    _set_local_only(False)
    import os

    assert LOCAL_ONLY_VAR not in os.environ and rc.ENABLE_RAY_CLUSTER is True
    _set_local_only(True)
    assert os.environ[LOCAL_ONLY_VAR] == "0" and rc.ENABLE_RAY_CLUSTER is False


@pytest.fixture(scope="module")
def head_cluster(session_ray_head):
    if session_ray_head:
        tmp = Path(os.environ["RAY_TMPDIR"])
        assert (tmp / "ray" / "ray_current_cluster").exists()
        yield tmp, session_ray_head
        return
    head = LoopbackHead("rlh-", 1, child_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_ADDRESS=None))
    try:
        assert head.started.returncode == 0, head.started.stdout + head.started.stderr
        assert (head.tmp / "ray" / "ray_current_cluster").exists()
        yield head.tmp, head.address
    finally:
        head.stop()


def _sessions(tmp: Path) -> set[str]:
    return {p.name for p in (tmp / "ray").glob("session_2*")}


@pytest.mark.slow
def test_local_run_ignores_a_cluster_recorded_on_the_machine(head_cluster, tmp_path):
    """With a cluster recorded in ray_current_cluster and no RAY_ADDRESS, `rl train` starts
    its own private Ray (a new session) instead of dying on `ray.init(num_cpus=...)`."""
    tmp, _ = head_cluster
    before = _sessions(tmp)
    r = subprocess.run(rl_cmd("train", *TINY, f"checkpoint.dir={tmp_path / 'ck'}"),
                       env=child_env(RAY_TMPDIR=str(tmp), RAY_ADDRESS=None), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "private local Ray" in r.stdout + r.stderr
    assert len(_sessions(tmp) - before) == 1


@pytest.mark.slow
def test_ray_address_in_environment_is_honoured_and_local_overrides_it(head_cluster, tmp_path):
    """RAY_ADDRESS set (as `ray job submit` sets it): the run joins that cluster (no new Ray
    session is started, and the plan says where Ray came from). The cluster is on loopback, so
    the driver stays on 127.0.0.1 (with the local-only setting removed, Ray rewrites 127.0.0.1
    to the machine's network address and never connects). `trainer.ray_address=local` starts a
    private Ray anyway."""
    tmp, address = head_cluster
    before = _sessions(tmp)
    r = subprocess.run(rl_cmd("train", *TINY, f"checkpoint.dir={tmp_path / 'joined'}"),
                       env=child_env(RAY_TMPDIR=str(tmp), RAY_ADDRESS=address), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Ray cluster at {address} (from RAY_ADDRESS)" in r.stdout + r.stderr
    assert _sessions(tmp) == before
    r = subprocess.run(rl_cmd("train", *TINY, "trainer.ray_address=local", f"checkpoint.dir={tmp_path / 'own'}"),
                       env=child_env(RAY_TMPDIR=str(tmp), RAY_ADDRESS=address), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "private local Ray" in r.stdout + r.stderr
    assert len(_sessions(tmp) - before) == 1


def test_joining_an_address_where_nothing_listens_is_bounded():
    """`trainer.ray_address=127.0.0.1:<port>` with nothing there hung without limit in ray.init
    (issue 42): the connection is tried until trainer.ray_connect_timeout_s, then a UserError names
    the address and what was tried. An address that accepts connections passes at once, and a local
    run or `auto` tries nothing. Loopback only."""
    import socket
    import time

    from engine.errors import UserError
    from engine.trainer.ray_cluster import wait_reachable

    with socket.socket() as s:  # a free port, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        wait_reachable(RayTarget(f"127.0.0.1:{port}", "trainer.ray_address"), timeout_s=2.0, poll_s=0.5)
    took = time.monotonic() - t0
    assert 1.5 <= took < 10, took
    msg = e.value.message
    assert f"127.0.0.1:{port}" in msg and "attempt" in msg and "trainer.ray_connect_timeout_s" in msg, msg
    with socket.socket() as srv:  # something listening: no wait
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        t0 = time.monotonic()
        wait_reachable(RayTarget(f"ray://127.0.0.1:{srv.getsockname()[1]}", "RAY_ADDRESS"), timeout_s=5.0)
        assert time.monotonic() - t0 < 2
    wait_reachable(RayTarget("", "local"), timeout_s=0.1)
    wait_reachable(RayTarget("auto", "trainer.ray_address"), timeout_s=0.1)
