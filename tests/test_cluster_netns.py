"""`rl train` on a real two-host Ray cluster (issue 16): two network namespaces, one Ray node
each (1 CPU), joined over a veth pair at 10.231.0.1 / 10.231.0.2, sharing the filesystem except
one directory that host B sees privately. The driver runs on host A (`ip netns exec`).

The cluster runs with Ray's token authentication on (RAY_AUTH_MODE=token, the token in
RAY_AUTH_TOKEN on both nodes and the driver, tests/netns_cluster.py).

Protects: ranks placed on both hosts meet at rank 0's node address (not 127.0.0.1) and train
like a single-node run; an unplaceable request and a checkpoint dir not shared by every node
are refused at start; losing host B mid-run ends the run cleanly naming the rank and node,
and `rl resume` finishes it once the host is back; a driver without the cluster's token, or
with a wrong one, is refused at once (exit 2) naming the address and the fix."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.netns_cluster import HEAD_IP, WORKER_IP, TwoHosts
from tests.ray_procs import child_env, metrics_rows, plain, rl_cmd, wait_for

pytestmark = pytest.mark.slow

RUN = ("trainer.nprocs=2", "trainer.threads_per_rank=1", "data.train_batch_size=4", "algorithm.rollout_n=2")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared")
    (shared / "private_view").mkdir()
    private = tmp_path_factory.mktemp("only_b")
    h = TwoHosts(private_view=shared / "private_view", private_dir=private)
    try:
        h.create()
        h.start_head()
        h.start_worker()
        h.wait_nodes(2)
        yield h, shared
    finally:
        h.close()


def _train_on_cluster(h: TwoHosts, *args) -> subprocess.CompletedProcess:
    return h.run("A", rl_cmd("train", f"trainer.ray_address={h.address}", *args, "--json"), timeout=900)


def test_two_ranks_on_two_hosts_match_single_node(hosts, tmp_path):
    h, shared = hosts
    r = _train_on_cluster(h, *RUN, "trainer.nnodes=2", "trainer.total_steps=3", "checkpoint.save_final=false",
                          f"checkpoint.dir={shared / 'two_hosts'}")
    assert r.returncode == 0, r.stderr[-4000:]
    placement = json.loads(r.stdout)["placement"]
    assert sorted(p["node_ip"] for p in placement) == [HEAD_IP, WORKER_IP], placement  # either rank on either host
    assert len({p["node_id"] for p in placement}) == 2, placement
    ref = subprocess.run(rl_cmd("train", *RUN, "trainer.total_steps=3", "checkpoint.save_final=false",
                                f"checkpoint.dir={tmp_path / 'one_host'}", "--json"),
                         env=child_env(), capture_output=True, text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-4000:]
    got, want = metrics_rows(shared / "two_hosts"), metrics_rows(tmp_path / "one_host")
    assert [x["step"] for x in got] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g["reward_mean"] == w["reward_mean"], (g, w)
        for k in ("pg_loss", "grad_norm", "entropy"):
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (k, g, w)
        assert g["driver_bytes"]["sent"] > 0 and g["driver_bytes"]["received"] > 0


@pytest.mark.parametrize("token", [None, "not-the-clusters-token-5f1c"], ids=["missing", "wrong"])
def test_driver_without_the_clusters_token_is_refused_naming_the_fix(hosts, token):
    """A driver on host A with no token (RAY_AUTH_MODE unset, as a user who never heard of it)
    or a wrong one: exit 2 within seconds (Ray alone retried ~20 s, printing a warning a second,
    then said only "Failed to connect"), one paragraph naming the cluster's address and the
    fix (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), never the token sent; nothing written."""
    h, shared = hosts
    d = shared / f"no_token_{token is None}"
    env = {"RAY_AUTH_MODE": None if token is None else "token", "RAY_AUTH_TOKEN": token}
    t0 = time.monotonic()
    r = h.run("A", rl_cmd("train", f"trainer.ray_address={h.address}", *RUN, "trainer.total_steps=1",
                          f"checkpoint.dir={d}"), timeout=300, env_extra=env)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    err = plain(r.stderr)
    assert "requires token authentication" in err and h.address in err, err
    assert "RAY_AUTH_MODE=token" in err and "RAY_AUTH_TOKEN" in err, err
    assert ("sent no token" in err) if token is None else ("rejected the token" in err), err
    assert "Traceback" not in err and "InvalidAuthToken" not in err and "Failed to connect" not in err, err
    assert token is None or token not in r.stdout + r.stderr
    assert took < 90, f"refused after {took:.0f} s"  # rl's start-up and one GCS request, however loaded
    assert not metrics_rows(d) and not list(d.glob("step_*"))


def test_unplaceable_request_is_refused_naming_the_cluster(hosts):
    """3 ranks of 1 CPU on two 1-CPU nodes: refused before anything waits on the placement
    group (the 'cannot be placed' path checks the nodes' totals), with the nodes listed; no
    step ran."""
    h, shared = hosts
    r = _train_on_cluster(h, "trainer.nprocs=3", f"checkpoint.dir={shared / 'too_big'}")
    assert r.returncode == 2, r.stderr[-3000:]
    err = plain(r.stderr)
    assert "cannot be placed" in err and f"{HEAD_IP} (1 CPU" in err and f"{WORKER_IP} (1 CPU" in err, err
    assert "Traceback" not in err
    assert not metrics_rows(shared / "too_big") and not list((shared / "too_big").glob("step_*"))


def test_checkpoint_dir_not_shared_by_every_node_is_refused(hosts):
    """Host B sees a private directory at the checkpoint path: the driver's marker is not
    visible to the rank placed there, and the run is refused naming that rank and node (the
    rank on host A sees it and is not named); no step ran and the marker is removed."""
    h, shared = hosts
    d = shared / "private_view" / "ck"
    r = _train_on_cluster(h, *RUN, "trainer.nnodes=2", "trainer.total_steps=1", f"checkpoint.dir={d}")
    assert r.returncode == 2, r.stderr[-3000:]
    err = plain(r.stderr)
    assert "not shared with every rank" in err and f"on node {WORKER_IP}" in err, err
    assert f"on node {HEAD_IP}" not in err and "Traceback" not in err
    assert not metrics_rows(d) and not list(d.glob("step_*")) and not list(d.glob(".rl-shared-check-*"))


@pytest.mark.timeout(1200)
def test_losing_the_second_host_mid_run_then_resume_finishes(hosts):
    h, shared = hosts
    h.wait_nodes(2)
    d = shared / "killed"
    # ray_timeout_s: a stuck start-up or collective ends the run with a message naming what it
    # waited on, well inside the wait below (which shows the run's output)
    log = shared / "killed.log"
    proc = h.popen("A", rl_cmd("train", f"trainer.ray_address={h.address}", *RUN, "trainer.nnodes=2",
                               "trainer.total_steps=2000", "checkpoint.save_freq=1", "trainer.ray_timeout_s=240",
                               f"checkpoint.dir={d}"), log=log)
    try:
        try:
            # any complete checkpoint: retention (checkpoint.keep_last) removes step_1 within a few
            # steps, which on a quiet machine can pass between two polls
            wait_for(lambda: len(metrics_rows(d)) >= 2 and any(d.glob("step_*/manifest.json")), 420,
                     "two steps and a checkpoint", proc)
        except AssertionError as e:
            raise AssertionError(f"{e}\nthe run's output:\n{log.read_text()[-4000:]}") from None
        h.kill_host("B")
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    out = log.read_text()
    assert proc.returncode == 1, out[-4000:]
    text = plain(out)
    assert f"on node {WORKER_IP}" in text and "rank lost" in text and "rl resume" in text, text[-4000:]
    assert re.search(rf"rank [01] on node {re.escape(WORKER_IP)} .* was lost while waiting for \w", text), text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    done = max(int(p.name.split("_")[1]) for p in d.glob("step_*") if (p / "manifest.json").exists())
    h.start_worker()
    h.wait_nodes(2)
    r = h.run("A", rl_cmd("resume", str(d), f"trainer.total_steps={done + 2}", "--json"), timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout)["last_step"] == done + 2
    assert [x["step"] for x in metrics_rows(d)] == list(range(1, done + 3))
