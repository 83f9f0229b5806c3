"""Routing records through torch.distributed collectives.

Records are int16 (more than 255 experts); NCCL has no int16 type, so they cross as a uint8 view
of the same bytes (``[..., k]`` int16 -> ``[..., 2k]`` uint8, no copy) and are viewed back on
arrival: exact for every value, negative "no record" entries included. Gloo takes the same path,
so one code path is tested on CPU. Ranks may hold different token counts: sizes are exchanged
first and each rank's records padded with "no record" to the largest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.moe.routing_records import NO_RECORD, ROUTING_DTYPE


def as_wire(records: torch.Tensor) -> torch.Tensor:
    """int16 records -> their bytes as uint8 (last dim doubled), sharing storage."""
    if records.dtype != ROUTING_DTYPE:
        raise TypeError(f"routing records are {ROUTING_DTYPE}, got {records.dtype}")
    return records.contiguous().view(torch.uint8)


def from_wire(wire: torch.Tensor) -> torch.Tensor:
    """The inverse of ``as_wire``."""
    return wire.contiguous().view(ROUTING_DTYPE)


def all_gather_records(records: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``[tokens, ...]`` int16 records (tokens may differ per rank), in rank order."""
    world = dist.get_world_size(group)
    dev = records.device
    n = torch.tensor([records.shape[0]], dtype=torch.long, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s) for s in sizes]
    top = max(sizes)
    padded = records
    if records.shape[0] < top:
        extra = records.new_full((top - records.shape[0],) + tuple(records.shape[1:]), NO_RECORD)
        padded = torch.cat([records, extra])
    wire = as_wire(padded)
    out = [torch.empty_like(wire) for _ in range(world)]
    dist.all_gather(out, wire, group=group)
    return [from_wire(w)[:s] for w, s in zip(out, sizes)]
