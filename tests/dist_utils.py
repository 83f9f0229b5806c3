"""Run a function on N real gloo ranks (processes on 127.0.0.1) and collect results.

The ranks are forked from a multiprocessing fork server that has imported torch, transformers and
the backends once (``PRELOAD``), instead of each starting a fresh interpreter (``spawn``) that
imports them again: ~4-5 CPU-s per rank, and the suite starts ~90 of them (docs/benchmarks.md,
"Test suite"). Each rank still is a new process, forked from a server that has done nothing but
import; it gets the test process's environment, working directory and sys.path, as a spawned one
would."""

from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp

# what the fork server imports before it forks the first rank (a module missing here is skipped)
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "engine.backends.fsdp.engine", "megatron.core",
           "engine.backends.megatron.engine"]


def _entry(rank: int, world: int, store_path: str, fn, args, out_dir: str) -> None:
    import pickle

    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    exit_after_barrier()


def exit_after_barrier() -> None:
    """End a spawned rank once every rank is done. Tearing a gloo group down (or letting the
    interpreter finalise it) intermittently aborts with "terminate called without an active
    exception" on this torch build; the results are already on disk, so skip the teardown."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _with_env(rank: int, env: dict, fn, args) -> None:
    os.environ.clear()  # the test process's environment now, not the fork server's from its start
    os.environ.update(env)
    fn(rank, *args)


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from the fork server (as ``mp.spawn``
    would start them, with this process's environment), joined; raises if any fails."""
    mp.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of this process
    mp.start_processes(_with_env, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def run_ranks(fn, world: int, *args):
    """fn(rank, world, *args) on ``world`` gloo ranks; returns the list of per-rank results."""
    import pickle

    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        start_ranks(_entry, (world, store, fn, args, d), world)
        out = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def full_tensor(t):
    """The whole tensor of an FSDP2 DTensor parameter, or the tensor itself (a one-rank CPU
    engine trains the plain model: engine.fsdp_unit=auto)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
