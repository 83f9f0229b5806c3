"""Weights read once per run, on rank 0; every other rank receives only its shards.

Without this, each FSDP rank reads (or randomly initialises) the whole model in fp32 on its host
before sharding it: a host running N ranks holds N full copies at build time (8 ranks of a 7B
model: 8 x 28 GB, twice that with a KL reference). verl and torchtune build on rank 0 alone for
the same reason. Here the other ranks build the same modules on the meta device (no storage),
``fully_shard`` them, allocate only their shards (``to_empty``), and receive the values from rank
0 one tensor at a time (torch.distributed.checkpoint's ``set_model_state_dict`` with
``broadcast_from_rank0``). Buffers, which no state dict may hold (a rotary embedding's
``inv_freq`` is non-persistent), follow by broadcast, and so does rank 0's global RNG state, so
every rank leaves the build with the generator state it had when every rank built the model
itself. The values each rank trains are the slices of rank 0's tensors, which is what each rank
sliced from its own identical copy before: runs are unchanged, bit for bit.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def reads_weights(units: str, world_size: int) -> bool:
    """Does this rank build the model with its values? Rank 0 always; every rank when the model
    is not sharded (``units == "none"``: each rank trains a whole copy) or runs alone."""
    if units == "none" or world_size == 1 or not dist.is_initialized():
        return True
    return dist.get_rank() == 0


def built_on_every_rank(build: Callable[[], T]) -> T:
    """``build()`` on every rank -- rank 0 reads the weights, the others build meta modules -- and
    whether it worked, agreed: a rank whose build raised (an unreadable or unsafe checkpoint is
    read on rank 0 alone) raises its error, and every other rank raises the same one, instead of
    waiting in the broadcast for weights that never come (gloo's timeout is 30 minutes)."""
    from engine import errors

    result, error = None, None
    try:
        result = build()
    except Exception as e:  # noqa: BLE001 -- every rank must hear of it before anyone raises
        error = e
    said = None
    if error is not None:
        user = isinstance(error, errors.UserError)
        said = (type(error).__name__ if user else None, getattr(error, "message", str(error)),
                getattr(error, "title", None))
    heard: list = [None] * dist.get_world_size()
    dist.all_gather_object(heard, said)
    if error is not None:
        raise error
    for rank, told in enumerate(heard):
        if told is not None:
            kind, message, title = told
            cls = getattr(errors, kind, None) if kind else None
            if isinstance(cls, type) and issubclass(cls, errors.UserError):  # the same one-paragraph answer
                raise errors.UserError(message, title=title) if cls is errors.EnvironmentFailed else cls(message, title=title)
            raise RuntimeError(f"rank {rank} could not build the model: {message}")
    return result


def full_state(model: torch.nn.Module | None) -> tuple[dict, dict]:
    """Rank 0, before sharding: references (no copies) to ``model``'s whole tensors and buffers,
    which ``receive_weights`` sends after ``fully_shard`` has replaced the parameters."""
    if model is None:
        return {}, {}
    return dict(model.state_dict()), dict(model.named_buffers())


def receive_weights(model: torch.nn.Module, device: torch.device, state: tuple[dict, dict]) -> None:
    """Every rank, after ``fully_shard``: rank 0 passes ``full_state`` of its model as it was
    built, the others ``({}, {})`` and a model whose storage is still on the meta device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full, buffers = state
    if dist.get_rank() != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buf in model.named_buffers():  # the non-persistent ones are in no state dict
        if dist.get_rank() == 0:
            buf.copy_(buffers[name])
        dist.broadcast(buf, src=0)


def share_rank0_object(value):
    """``value`` as rank 0 has it, on every rank (a LoRA base reference, an RNG state)."""
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share_rank0_rng() -> None:
    """Rank 0's global torch generator state on every rank: the meta ranks drew no random numbers
    while building (a LoRA adapter's init, a value head's), rank 0 did."""
    torch.set_rng_state(share_rank0_object(torch.get_rng_state()))
