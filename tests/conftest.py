"""Shared test settings: small thread counts (CI has 2 cores), Ray bound to loopback, no
inherited RAY_ADDRESS (a developer's cluster must not be joined by the tests), and one Ray
head for the whole session that the runs join.

The session's Ray head: every real `rl train`/`rl resume` used to start and stop its own
private Ray, ~3 s of each run's ~11 s (docs/benchmarks.md, "Test suite"), and the suite makes
~110 of them. Here one loopback head (tests/ray_procs.LoopbackHead, with no prestarted
workers) is started once and RAY_ADDRESS points the runs at it: the documented way to run on
an existing cluster (engine/trainer/ray_cluster.py), so each run is still a
real Ray job with its own placement group and rank actors. The tests of the private Ray
itself opt out by unsetting RAY_ADDRESS for their runs: test_listeners (loopback sockets and
the reaper after SIGKILL), test_cluster_local, the network-namespace clusters and
test_resume's SIGKILL runs (a killed driver's ranks must die with its session there).
`RL_TEST_PRIVATE_RAY=1` runs the whole suite on private Rays, as before.
Teardown ends exactly this head's processes (never `ray stop`, which ends every Ray on the
machine) and removes its temp dir."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("RAY_ADDRESS", None)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION_RAY_CPUS = 8  # logical CPUs: room for a 2-rank run while a killed run's actors wind down


@pytest.fixture(scope="session", autouse=True)
def session_ray_head():
    if os.environ.get("RL_TEST_PRIVATE_RAY") == "1":
        yield None
        return
    from tests.ray_procs import LoopbackHead

    head = LoopbackHead("rls-", SESSION_RAY_CPUS, {**os.environ, "PYTHONPATH": REPO},
                        '--system-config={"prestart_worker_first_driver": false}')
    try:
        r = head.started
        assert r.returncode == 0, f"the session's Ray head did not start:\n{r.stdout}\n{r.stderr}"
        os.environ["RAY_TMPDIR"] = str(head.tmp)
        os.environ["RAY_ADDRESS"] = head.address
        yield head.address
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        os.environ.pop("RAY_TMPDIR", None)
        head.stop()
