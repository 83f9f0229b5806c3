"""Rank thread counts: fixed for the run by default, load-following only when asked.

Protects bit-reproducibility: torch splits a float sum across its intra-op threads, so the same
step gives different bits with 1 and 2 threads. A default run must therefore keep its thread
count whatever the machine's load; `trainer.adapt_threads=true` trades that for steadier speed
on a shared machine (docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine.threads
from engine.config.load import load_run_config
from engine.config.resolved import resolve_run


def test_thread_count_changes_float_sums_which_is_why_it_is_fixed_by_default():
    x = torch.randn(64, 100_000, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = x.sum()
        torch.set_num_threads(2)
        two = x.sum()
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(one, two)


@pytest.mark.parametrize("adapt, expected", [(False, 2), (True, 1)])
def test_rank_keeps_its_threads_on_a_busy_machine_unless_adapt_threads(monkeypatch, adapt, expected):
    from engine.trainer.worker import RankWorker

    monkeypatch.setattr(engine.threads, "busy_cpus", lambda: 64)  # every core taken by others
    monkeypatch.setattr(engine.threads.os, "cpu_count", lambda: 2)
    cfg = load_run_config(["data.train_batch_size=2", "algorithm.rollout_n=2", "rollout.max_new_tokens=4",
                           "trainer.device=cpu", f"trainer.adapt_threads={str(adapt).lower()}"]).config
    before = torch.get_num_threads()
    w = RankWorker(resolve_run(cfg), 0, 1, 2)
    try:
        w.setup(*w.open_rendezvous(), "", {"size": 64, "pad": 0, "eos": 1})
        w.onload(0)
        w.generate([[5, 6, 7], [8, 9]], 2)
        assert torch.get_num_threads() == expected
    finally:
        w.shutdown()
        torch.set_num_threads(before)


def test_a_failing_preload_import_does_not_fail_the_rank_start(monkeypatch):
    """A rank imports transformers while the driver is still starting up (the early launch). When
    that import fails, the rank must still start: the failure is left to setup(), which imports
    what it builds with, so the run reports a setup error rather than an actor that never came up
    (which reads as a lost rank)."""
    from engine.trainer.worker import RankWorker

    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", None)  # any import of it fails
    cfg = load_run_config(["data.train_batch_size=2", "algorithm.rollout_n=2", "rollout.max_new_tokens=4",
                           "trainer.device=cpu"]).config
    before = torch.get_num_threads()
    try:
        RankWorker(resolve_run(cfg), 0, 1, 1).shutdown()
    finally:
        torch.set_num_threads(before)


def test_rank_env_is_passive_unless_the_user_chose_a_wait_policy(monkeypatch):
    """Ranks get passive OpenMP waits by default; a user's own OMP_WAIT_POLICY, KMP_BLOCKTIME and
    GOMP_SPINCOUNT reach them as set (explicitly: a joined cluster's workers do not inherit the
    driver's environment)."""
    from engine.threads import rank_env

    for k in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT", "LRU_CACHE_CAPACITY",
              "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(k, raising=False)
    env = rank_env(2)
    env.pop("RL_RANK_NICENESS")  # the driver's scheduling priority (below)
    assert env == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0",
                   # oneDNN's and ideep's shape-keyed kernel caches, bounded (engine/host_heap.py)
                   "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")   # the user's own bound is passed on
    assert rank_env(2)["LRU_CACHE_CAPACITY"] == "64"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")
    env = rank_env(0)
    assert env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "ACTIVE" and env["GOMP_SPINCOUNT"] == "3000"


RESTORE = r"""
import glob, json, os, sys, threading
os.nice(10)                                   # what Ray's worker_niceness does to a rank (15 there)
started = threading.Event()
t = threading.Thread(target=started.wait, daemon=True); t.start()   # a thread that exists already
os.environ["RL_RANK_NICENESS"] = sys.argv[1]        # the launching command's niceness
from engine.threads import restore_rank_priority
note = restore_rank_priority()
nice = sorted({os.getpriority(os.PRIO_PROCESS, int(p.rsplit("/", 1)[1])) for p in glob.glob("/proc/self/task/*")})
started.set()
print(json.dumps({"note": note, "nice": nice}))
"""

# whether this machine lets a process take back a niceness it gave up (root with CAP_SYS_NICE,
# or RLIMIT_NICE): the same change restore_rank_priority makes
CAN_RAISE = r"""
import os
base = os.getpriority(os.PRIO_PROCESS, 0)
os.nice(1)
try:
    os.setpriority(os.PRIO_PROCESS, 0, base)
except OSError:
    print("no")
else:
    print("yes")
"""


def test_a_rank_started_below_the_drivers_priority_gets_it_back_or_says_why():
    """Ray starts workers at niceness 15, under which any ordinary process on a busy machine
    takes the CPU first (1.92x against 1.41x a step with one busy process). A rank restores the
    launching command's niceness on every thread where the OS allows it (root, CAP_SYS_NICE),
    else returns a note naming the fix (RAY_worker_niceness=0).

    Whether the OS allows it is asked of the OS (a root without CAP_SYS_NICE, as in a default
    Docker container, may not; a user with CAP_SYS_NICE or RLIMIT_NICE may), and the launching
    niceness is this process's own (pytest may run under `nice`)."""
    import json
    import os
    import subprocess

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base + 10 > 19:
        pytest.skip(f"running at niceness {base}: no room to start a rank 10 below it")
    out = subprocess.run([sys.executable, "-c", CAN_RAISE], capture_output=True, text=True, check=True)
    allowed = out.stdout.strip() == "yes"
    out = subprocess.run([sys.executable, "-c", RESTORE, str(base)], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if allowed:
        assert res == {"note": "", "nice": [base]}, res
    else:
        assert "RAY_worker_niceness=0" in res["note"] and res["nice"] == [base + 10], res


PRIVATE_RAY_NICENESS = """
import glob, json, os
from engine.trainer.ray_cluster import ray_cluster

class Rank:  # ranks are actors (engine/trainer/worker_group.py)
    def niceness(self):
        import glob, os
        return sorted({os.getpriority(os.PRIO_PROCESS, int(p.rsplit("/", 1)[1])) for p in glob.glob("/proc/self/task/*")})

with ray_cluster("local", 1) as (ray, _):
    rank = ray.remote(num_cpus=1)(Rank).remote()
    print(json.dumps({"driver": os.getpriority(os.PRIO_PROCESS, 0), "rank": ray.get(rank.niceness.remote(), timeout=120)}))
"""


def test_rank_env_carries_the_drivers_niceness_and_the_private_ray_keeps_it():
    """The ranks learn the driver's niceness from their environment, and a worker of rl's
    private Ray runs at it on every thread (worker_niceness 0), not at Ray's 15. The private Ray is
    started from a fresh driver process, as `rl train` starts it (the test process's own threads
    and Ray state after other tests are not what a run starts from)."""
    import json
    import os
    import subprocess

    driver = os.getpriority(os.PRIO_PROCESS, 0)
    assert engine.threads.rank_env(2)["RL_RANK_NICENESS"] == str(driver)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", PRIVATE_RAY_NICENESS], capture_output=True, text=True, timeout=300,
                         env=env, cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rank"] == [got["driver"]], got


def test_omp_wait_spins_briefly_on_a_free_machine_and_sleeps_on_a_busy_one(monkeypatch):
    """trainer.omp_wait: ``spin`` gives ranks a bounded spin (GOMP_SPINCOUNT=SHORT_SPIN) before
    their idle OpenMP threads sleep, ``passive`` none, and ``auto`` spins only when the machine has
    a free core for every rank thread at launch; a bad value is refused by name."""
    import pytest

    from engine import threads

    assert threads.omp_spin_count("spin", 2) == threads.SHORT_SPIN > 0
    assert threads.omp_spin_count("passive", 2) == 0
    monkeypatch.setattr(threads, "free_cores", lambda: 2)
    assert threads.omp_spin_count("auto", 2) == threads.SHORT_SPIN
    assert threads.omp_spin_count("auto", 3) == 0          # more rank threads than free cores
    monkeypatch.setattr(threads, "free_cores", lambda: 0)  # another job holds every core
    assert threads.omp_spin_count("auto", 1) == 0
    with pytest.raises(ValueError, match="trainer.omp_wait must be one of auto, spin, passive"):
        threads.omp_spin_count("fast", 2)


def test_rank_env_carries_the_chosen_spin_unless_the_user_set_openmp_waits(monkeypatch):
    """The spin count rl chose reaches the ranks next to the passive policy; rl's own defaults
    (set by ``import engine``, listed in RL_OMP_DEFAULTED, inherited by child processes) are not
    taken for a user's choice, while a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins as set."""
    from engine import threads

    for k in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT", threads.DEFAULTED_ENV):
        monkeypatch.delenv(k, raising=False)
    threads.apply_process_defaults()  # what `import engine` does in a fresh process
    assert not threads.user_chose_omp_waits()
    env = threads.rank_env(2, spin=3000)
    assert (env["OMP_WAIT_POLICY"], env["KMP_BLOCKTIME"], env["GOMP_SPINCOUNT"]) == ("PASSIVE", "0", "3000")
    assert "GOMP_SPINCOUNT" not in threads.rank_env(2, spin=0)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own, here set after rl's defaults
    monkeypatch.setenv(threads.DEFAULTED_ENV, "KMP_BLOCKTIME")
    assert threads.user_chose_omp_waits()
    env = threads.rank_env(2, spin=3000)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in env
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    assert threads.rank_env(2, spin=3000)["GOMP_SPINCOUNT"] == "50"


def test_omp_wait_now_describes_the_environment(monkeypatch):
    """What a rank reports (and `rl train` shows as "openmp waits") follows its environment."""
    from engine.threads import omp_wait_now

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")
    assert omp_wait_now() == "spin 3000 counts, then sleep"
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert omp_wait_now() == "passive"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert omp_wait_now() == "passive"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two allowed cores")
def test_thread_counts_follow_the_cpu_affinity_not_the_machines_core_count():
    """Under `taskset -c 0` (or a cgroup cpuset, or Slurm's binding) a process may run on one core
    whatever os.cpu_count() says; rl's thread choices (adapt_threads, free_cores, the per-rank
    default) must count that one core, or ranks oversubscribe it and every intra-op barrier stalls."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            "from engine.threads import usable_cpus, free_cores, adapt_threads;"
            "print(os.cpu_count(), usable_cpus(), free_cores(samples=1), adapt_threads(8))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    machine, usable, free, threads = map(int, out)
    assert machine >= 2 and usable == 1 and free <= 1 and threads == 1, out


def test_a_cgroup_cpu_quota_caps_the_usable_cores(monkeypatch, tmp_path):
    """A container limited to 1.5 CPUs (cgroup v2 cpu.max "150000 100000") may use 2 cores' worth
    of threads at most, rounded up; "max" means no quota."""
    from engine import threads

    real_open = open

    def fake_open(path, *a, **k):
        if path == "/sys/fs/cgroup/cpu.max":
            return real_open(tmp_path / "cpu.max", *a, **k)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.usable_cpus() == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.usable_cpus() == 64


def test_importing_the_engine_changes_nothing_in_the_process():
    """`import engine` (and its light modules) leaves the environment as it was: a library that
    sets OpenMP variables on import changes a host program's threads behind its back. The `rl`
    command applies rl's process defaults at its start instead (rlcli/main.py)."""
    code = ("import os, json; before = dict(os.environ);"
            "import engine, engine.threads, engine.config.load, engine.trainer.trainer, engine.backends.base;"
            "print(json.dumps(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))))")
    env = {k: v for k, v in os.environ.items() if k not in engine.threads.PASSIVE_OMP_ENV
           and k != engine.threads.DEFAULTED_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]", out


def test_the_rl_command_applies_the_process_defaults_at_its_start():
    env = {k: v for k, v in os.environ.items() if k not in engine.threads.PASSIVE_OMP_ENV
           and k != engine.threads.DEFAULTED_ENV}
    code = ("import os, sys; sys.argv = ['rl', '--help'];"
            "import rlcli.main as m\ntry:\n    m.main()\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('" + engine.threads.DEFAULTED_ENV + "', ''), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1])
    assert set(r.stderr.strip().splitlines()[-1].split(",")) == set(engine.threads.PASSIVE_OMP_ENV), r.stderr
