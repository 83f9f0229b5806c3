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

Two test processes (pytest-xdist, `-n 2 --dist worksteal` in the README's command: an idle worker takes queued tests from the other, so the long end-to-end runs do not leave one core waiting at the end): the suite is mostly real
`rl` processes starting, importing and waiting on each other, so two at a time finish sooner on
two cores. Each worker has its own Ray head. A test marked `alone` (one that measures speed)
runs with no other test running: every test holds a shared lock on one file for the test run,
an `alone` test an exclusive one, and a turnstile lock in front keeps the exclusive waiter from
being starved by the other worker's stream of shared ones.
Teardown ends exactly this head's processes (never `ray stop`, which ends every Ray on the
machine) and removes its temp dir."""

import fcntl
import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from engine.threads import apply_process_defaults  # noqa: E402

apply_process_defaults()  # as the `rl` command does at its start: this process and every one it spawns
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The repo's modules compiled once per test run rather than by every process: where the machine
# sets PYTHONDONTWRITEBYTECODE (these machines do), each of the suite's ~600 `rl` drivers and rank
# processes compiled engine/ from source again, ~2% of the suite's CPU (docs/benchmarks.md, "Test
# suite"). __pycache__ is git-ignored.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
os.environ.pop("RAY_ADDRESS", None)
# Output drawn as CI draws it (not a terminal: 80 columns, no colour), whatever started pytest:
# rich takes its width from COLUMNS, else from any standard stream that is a terminal (stdin
# under `pytest -s`), and colours a pipe under FORCE_COLOR/TTY_COMPATIBLE (CI configs often
# set FORCE_COLOR=1), which wrapped or split the text the tests look for. Tests of these
# settings set them on their own commands.
os.environ["COLUMNS"] = "80"
for _var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
    os.environ.pop(_var, None)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEAD: list = []  # this process's session Ray head, for the CPU log below
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
        _HEAD.append(head)
        yield head.address
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        os.environ.pop("RAY_TMPDIR", None)
        head.stop()


def _lock(path: str, mode: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, mode)
    return fd


@pytest.fixture(autouse=True)
def _alone_or_shared(request):
    """Under xdist: an `alone` test runs while no other test does (see the module docstring)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    base = f"/tmp/rl-tests-{run}"
    alone = request.node.get_closest_marker("alone") is not None
    gate = _lock(base + ".turnstile", fcntl.LOCK_EX)
    try:
        if not alone:
            os.close(gate)  # through the turnstile; an `alone` test waiting holds it
            gate = None
        main = _lock(base + ".lock", fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    except BaseException:
        if gate is not None:
            os.close(gate)
        raise
    try:
        yield
    finally:
        os.close(main)
        if gate is not None:
            os.close(gate)


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """One small real `rl train` of the default job (``SMALL_RUN``: 2 steps, 4 prompts x 2 samples,
    every row trained, checkpoints at the default frequency), made once per test run and shared by
    both xdist workers: the tests that only read a real run's files (mem-report, the checkpoint
    damage cases, the override fuzzing) use it. Read-only: a test that changes files copies it.
    The first worker to get here trains it under an exclusive lock; the other waits and reuses it."""
    from tests.cli_utils import SMALL_RUN, rl

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the workers' common dir
    run = root / "small-run" / "ckpt"
    fd = _lock(str(root / "small-run.lock"), fcntl.LOCK_EX)
    try:
        if not (run.parent / "done").exists():
            import shutil

            shutil.rmtree(run.parent, ignore_errors=True)  # a failed earlier attempt
            run.parent.mkdir(parents=True)
            r = rl("train", *SMALL_RUN, f"checkpoint.dir={run}", cwd=run.parent)
            assert r.returncode == 0, r.stderr[-3000:]
            (run.parent / "done").write_text("")
    finally:
        os.close(fd)
    return run


@pytest.fixture(autouse=True)
def _forget_env_values():
    """Values read from the environment are hidden from every later message of the process
    (engine/secret_values.py): a test's variables must not rewrite the next test's messages."""
    from engine.secret_values import forget_env_values

    forget_env_values()
    yield
    forget_env_values()



class _HeadCpu:
    """CPU-seconds of this worker's Ray head and every process under it (ranks, rollout and
    reward workers) while a test runs: sampled every 0.25 s, since the raylet does not account its
    exited workers' time; a process that lives less than one sample interval is missed."""

    def __init__(self):
        import threading

        self.seen: dict[int, float] = {}
        self.base: dict[int, float] = {}
        self.stop = threading.Event()
        self._sample(self.base)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _sample(self, into: dict) -> None:
        import psutil

        from tests.ray_procs import processes_naming

        if not _HEAD:
            return
        for p in processes_naming(str(_HEAD[0].tmp)) + processes_naming(_HEAD[0].address):
            try:
                t = p.cpu_times()
                into[p.pid] = t.user + t.system
            except psutil.Error:
                pass

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            self._sample(self.seen)

    def total(self) -> float:
        self.stop.set()
        self.thread.join()
        self._sample(self.seen)
        return sum(v - self.base.get(pid, 0.0) for pid, v in self.seen.items())


def _own_cpu_seconds() -> float:
    """This test process and the children it reaped (subprocess drivers and their private Rays)."""
    import resource

    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


@pytest.fixture(autouse=True)
def _cpu_log(request):
    """RL_TEST_CPU_LOG=FILE: one JSON line per test with the CPU-seconds it cost (this process and
    its reaped children; this worker's Ray head and the processes under it): which tests the
    suite's CPU goes to, per test rather than per wall-clock second (docs/benchmarks.md)."""
    path = os.environ.get("RL_TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import time

    t0, own0, head = time.monotonic(), _own_cpu_seconds(), _HeadCpu()
    yield
    ray_s, own_s = head.total(), _own_cpu_seconds() - own0
    with open(path, "a") as f:
        f.write(json.dumps({"test": request.node.nodeid, "wall_s": round(time.monotonic() - t0, 2),
                            "own_cpu_s": round(own_s, 2), "ray_cpu_s": round(ray_s, 2)}) + "\n")


@pytest.fixture(autouse=True)
def _timeline(request):
    """RL_TEST_TIMELINE=FILE: one JSON line per test with its xdist worker and its start and end
    (epoch seconds): whether one worker waits idle at the end while the other runs a long test."""
    path = os.environ.get("RL_TEST_TIMELINE")
    if not path:
        yield
        return
    import json
    import time

    start = time.time()
    yield
    with open(path, "a") as f:
        f.write(json.dumps({"test": request.node.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                            "start": round(start, 2), "end": round(time.time(), 2)}) + "\n")
