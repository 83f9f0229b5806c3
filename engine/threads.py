"""CPU threading that stays fast on a busy machine.

Why a step slowed ~45x under modest load: torch's OpenMP worker threads spin-wait (busy loop)
between parallel regions by default (libgomp ``OMP_WAIT_POLICY=ACTIVE``-like spinning; Intel
OpenMP ``KMP_BLOCKTIME=200`` ms). When every core is already taken -- by other processes, or by
the driver, Ray workers and reward code of the same run -- a spinning thread holds a core its
peer needs to finish the same region, so every barrier waits out a scheduler time slice. With
passive waiting the threads sleep at barriers and a loaded machine costs only the CPU share
that the load really takes (measured figures: docs/benchmarks.md, tests/test_busy_machine.py).

The OpenMP runtime reads these variables once, when torch loads it: ``apply_process_defaults``
must run before ``import torch`` (``import engine`` does it), and rank workers get them in their
environment from the start (``rank_env``). A value the user already set is kept.

Passive waits have a price on a quiet machine: every parallel region wakes a sleeping thread
(a futex wake, in a VM an interrupt to a halted vCPU), and an update is thousands of small
regions. A short, bounded spin before sleeping (libgomp's ``GOMP_SPINCOUNT``, ~49 ns a count
here) keeps the peer awake across the gap between two ops: the update of the issue-17 job took
188-213 ms with 3000 counts against 261-340 ms with none, in the same process layout
(docs/benchmarks.md, "OpenMP waits"). ``trainer.omp_wait`` picks it per run: ``auto`` spins
(``SHORT_SPIN``) when the launching machine has a core free for every rank thread, and sleeps at
once when it is already busy; ``spin`` and ``passive`` force either. A bounded spin cannot cause
the 45x above (a spinning thread gives its core back after ~150 us), but it costs ~1.2-1.5x under a
hog that arrives later, which is why a busy machine at launch gets none.
"""

from __future__ import annotations

import os

# passive OpenMP waits (libgomp and Intel OpenMP), set unless the user chose otherwise
PASSIVE_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
# a user's own spin setting, passed on to the ranks as they set it
USER_OMP_VARS = ("GOMP_SPINCOUNT",)
# trainer.omp_wait's bounded spin: libgomp spin counts before a waiting thread sleeps (~150 us here)
SHORT_SPIN = 3000


# the driver's scheduling priority, given to its ranks (``restore_rank_priority``)
RANK_NICENESS_ENV = "RL_RANK_NICENESS"


def _niceness() -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):  # not a POSIX system
        return None


def restore_rank_priority() -> str:
    """Run this rank at the priority of the command that launched it (``RL_RANK_NICENESS``).

    Ray starts its workers at niceness 15 (``worker_niceness``), so that its own daemons stay
    responsive. For a rank that is the job itself, that means any ordinary process on the machine
    takes the CPU first: with one busy process on 2 cores a step took 1.92x its quiet time at
    niceness 15 and 1.41x at the driver's 0 (docs/benchmarks.md, issue 17). rl's private Ray starts
    workers at the driver's niceness already (engine/trainer/ray_cluster.py); in a joined cluster
    this lowers each thread's niceness where the OS allows it. Returns '' or a one-line note
    saying why the rank stays below the driver's priority."""
    want = os.environ.get(RANK_NICENESS_ENV, "")
    now = _niceness()
    if not want.lstrip("-").isdigit() or now is None or now <= int(want):
        return ""
    try:  # on Linux niceness is per thread: every thread there now; later ones inherit it
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, int(want))
    except OSError as e:
        return (f"this rank runs at niceness {now}, below the launching command's {want} ({e.strerror}): on a "
                f"busy machine other processes take the CPU first. Start the Ray cluster with "
                f"RAY_worker_niceness=0 (e.g. `RAY_worker_niceness=0 ray start ...`) to run ranks at full priority.")
    return ""


# the variables of PASSIVE_OMP_ENV that rl set itself (not the user), inherited by child processes
DEFAULTED_ENV = "RL_OMP_DEFAULTED"


def apply_process_defaults() -> None:
    """Passive OpenMP waiting for this process (effective if torch is not imported yet); the
    variables set here are listed in ``RL_OMP_DEFAULTED``, so that they are not taken for the
    user's choice, here or in a child process."""
    ours = set(filter(None, os.environ.get(DEFAULTED_ENV, "").split(",")))
    for k, v in PASSIVE_OMP_ENV.items():
        if k not in os.environ:
            os.environ[k] = v
            ours.add(k)
    if ours:
        os.environ[DEFAULTED_ENV] = ",".join(sorted(ours))


def user_chose_omp_waits() -> bool:
    """Whether this process's environment already says how OpenMP threads wait (then rl passes
    it on as set and chooses nothing)."""
    ours = set(os.environ.get(DEFAULTED_ENV, "").split(","))
    return any(k in os.environ and k not in ours for k in (*PASSIVE_OMP_ENV, *USER_OMP_VARS))


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a cgroup cpuset, Slurm's
    binding), capped by a cgroup CPU quota (a container's ``--cpus``, Kubernetes limits), never
    ``os.cpu_count()`` alone, which counts every core of the machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def _cgroup_cpu_quota() -> int | None:
    """Whole cores allowed by this process's cgroup CPU quota (v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, rounded up), None when unlimited or unreadable."""
    import math

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    v2 = read("/sys/fs/cgroup/cpu.max")  # "max 100000" or "200000 100000"
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    q, p = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if q and p and q.lstrip("-").isdigit() and p.isdigit() and int(q) > 0 and int(p) > 0:
        return max(1, math.ceil(int(q) / int(p)))
    return None


def free_cores(samples: int = 5, interval_s: float = 0.02) -> int:
    """Cores that no other task holds, the most seen over ``samples`` readings of the runnable
    count (a start-up blip of Ray's own daemons does not make a quiet machine look busy)."""
    import time

    cores = usable_cpus()
    busy = []
    for i in range(max(1, samples)):
        if i:
            time.sleep(interval_s)
        busy.append(busy_cpus())
    return max(0, cores - min(busy))


def omp_spin_count(choice: str, threads: int) -> int:
    """``GOMP_SPINCOUNT`` for ranks that run ``threads`` intra-op threads on this machine in all
    (``trainer.omp_wait``): ``spin`` -> ``SHORT_SPIN``, ``passive`` -> 0, ``auto`` -> ``SHORT_SPIN``
    when a core is free for each of those threads now, else 0."""
    from engine.config.schema import OMP_WAIT_CHOICES

    if choice not in OMP_WAIT_CHOICES:
        raise ValueError(f"trainer.omp_wait must be one of {', '.join(OMP_WAIT_CHOICES)}, not {choice!r}")
    if choice == "auto":
        return SHORT_SPIN if free_cores() >= max(1, threads) else 0
    return SHORT_SPIN if choice == "spin" else 0


def omp_wait_now() -> str:
    """How this process's OpenMP threads wait, in words (what its environment told the runtime)."""
    spin = os.environ.get("GOMP_SPINCOUNT", "").strip()
    if spin and spin != "0":
        return f"spin {spin} counts, then sleep"
    return "passive" if spin == "0" else (os.environ.get("OMP_WAIT_POLICY", "").lower() or "runtime default")


def rank_env(threads: int, spin: int = 0) -> dict[str, str]:
    """Environment of a rank worker process: its intra-op thread count and passive waits after
    ``spin`` spin counts (``omp_spin_count``), or the wait settings the user chose (a joined
    cluster's workers do not inherit the driver's environment, so they are passed explicitly)."""
    from engine.host_heap import kernel_cache_env

    chose = user_chose_omp_waits()
    env = {k: os.environ.get(k, v) for k, v in PASSIVE_OMP_ENV.items()}
    env.update({k: os.environ[k] for k in USER_OMP_VARS if k in os.environ})
    if not chose and spin > 0:
        env["GOMP_SPINCOUNT"] = str(int(spin))
    nice = _niceness()
    if nice is not None:
        env[RANK_NICENESS_ENV] = str(nice)
    env.update(kernel_cache_env())  # oneDNN's shape-keyed caches, bounded (engine/host_heap.py)
    return {"OMP_NUM_THREADS": str(max(1, threads)), **env}


def configure_torch_threads(threads: int) -> None:
    """``threads`` intra-op threads and one inter-op thread (ranks run one op stream; extra
    inter-op threads only compete for the same cores)."""
    import torch

    torch.set_num_threads(max(1, threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already ran in this process
        pass


def busy_cpus() -> int:
    """Runnable tasks on the machine right now other than the caller (/proc/loadavg's
    instantaneous running count, minus this thread); 0 where it cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - 1)


def adapt_threads(max_threads: int) -> int:
    """Use at most ``max_threads`` intra-op threads, fewer when other tasks hold the cores:
    intra-op threads meet at a barrier after every op, so one thread that the scheduler parks
    behind another process stalls all of them; a thread count that fits the free cores does not.
    Returns the count set."""
    import torch

    cores = usable_cpus()
    n = max(1, min(max_threads, cores - busy_cpus()))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
