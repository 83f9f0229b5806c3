"""Run a function on N real gloo ranks (spawned processes on 127.0.0.1) and collect results."""

from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp


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


def run_ranks(fn, world: int, *args):
    """fn(rank, world, *args) on ``world`` gloo ranks; returns the list of per-rank results."""
    import pickle

    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        mp.start_processes(_entry, args=(world, store, fn, args, d), nprocs=world, join=True,
                           start_method="spawn")
        out = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def full_tensor(t):
    """The whole tensor of an FSDP2 DTensor parameter, or the tensor itself (a one-rank CPU
    engine trains the plain model: engine.fsdp_unit=auto)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
