"""Shared test settings: small thread counts (CI has 2 cores), Ray bound to loopback, no
inherited RAY_ADDRESS (a developer's cluster must not be joined by the tests), and one Ray
head for the whole session that the runs join.

The session's Ray head: every real `rl train`/`rl resume` used to start and stop its own
private Ray, ~3 s of each run's ~11 s (docs/benchmarks.md, "Test suite"), and the suite makes
~110 of them. Here one loopback head (`ray start --head` on 127.0.0.1, its own RAY_TMPDIR,
no prestarted workers, its Ray client server on a free port) is started once and RAY_ADDRESS points the runs at it: the documented
way to run on an existing cluster (engine/trainer/ray_cluster.py), so each run is still a
real Ray job with its own placement group and rank actors. The tests of the private Ray
itself opt out by unsetting RAY_ADDRESS for their runs: test_listeners (loopback sockets and
the reaper after SIGKILL), test_cluster_local, the network-namespace clusters and
test_resume's SIGKILL runs (a killed driver's ranks must die with its session there).
`RL_TEST_PRIVATE_RAY=1` runs the whole suite on private Rays, as before.
Teardown ends exactly this head's processes, found by its temp dir and by its address (the
Ray client server names only the latter; never `ray stop`, which ends every Ray on the
machine), and removes its temp dir."""

import os
import shutil
import subprocess
import sys
import tempfile

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
    from tests.ray_procs import free_port, kill_all, processes_naming

    tmp = tempfile.mkdtemp(prefix="rls-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    env = {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": REPO}
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray") or "ray"
    r = subprocess.run([ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                        f"--num-cpus={SESSION_RAY_CPUS}", "--include-dashboard=false", "--disable-usage-stats",
                        f"--ray-client-server-port={free_port()}",  # not 10001: never shared with another Ray
                        '--system-config={"prestart_worker_first_driver": false}'],
                       env=env, capture_output=True, text=True, timeout=180)
    try:
        assert r.returncode == 0, f"the session's Ray head did not start:\n{r.stdout}\n{r.stderr}"
        os.environ["RAY_TMPDIR"] = tmp
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        yield os.environ["RAY_ADDRESS"]
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        os.environ.pop("RAY_TMPDIR", None)
        kill_all(processes_naming(tmp) + processes_naming(f"127.0.0.1:{port}"))
        shutil.rmtree(tmp, ignore_errors=True)
