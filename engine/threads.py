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
"""

from __future__ import annotations

import os

# passive OpenMP waits (libgomp and Intel OpenMP), set unless the user chose otherwise
PASSIVE_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
# a user's own spin setting, passed on to the ranks as they set it. On a dedicated, otherwise
# idle machine a short spin before sleeping (``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=3000``,
# ~150 us here) saves the wake-up of every parallel region; measured figures and the cost on a
# busy machine: docs/benchmarks.md, "Busy machine".
USER_OMP_VARS = ("GOMP_SPINCOUNT",)


def apply_process_defaults() -> None:
    """Passive OpenMP waiting for this process (effective if torch is not imported yet)."""
    for k, v in PASSIVE_OMP_ENV.items():
        os.environ.setdefault(k, v)


def rank_env(threads: int) -> dict[str, str]:
    """Environment of a rank worker process: its intra-op thread count and passive waits, or
    the wait settings the user chose (a joined cluster's workers do not inherit the driver's
    environment, so they are passed explicitly)."""
    env = {k: os.environ.get(k, v) for k, v in PASSIVE_OMP_ENV.items()}
    env.update({k: os.environ[k] for k in USER_OMP_VARS if k in os.environ})
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

    cores = os.cpu_count() or 1
    n = max(1, min(max_threads, cores - busy_cpus()))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
