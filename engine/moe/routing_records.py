"""Routing records: the top-k expert indices a mixture-of-experts router chose, per token and layer.

A record is an int16 tensor ``[..., layers, k]`` (``[B, T, L, k]`` inside a SequenceBatch,
``[tokens, L, k]`` for a flat run of tokens): int16 so that more than 255 experts fit, and
``k`` entries per token in the router's own order (descending router probability).

"No record here" is a token whose ``k`` entries are not distinct (verl's convention: a real
top-k never picks one expert twice, so no separate mask travels with the records). Padding fills
with ``NO_RECORD`` (-1), which is both a duplicate (k >= 2) and negative (so k = 1 routers can
tell too). Pad tokens, and positions the rollout never ran through the model (each response's
last token), carry no record; the trainer's routers take their own choice there.
"""

from __future__ import annotations

import torch

from engine.batch import NO_RECORD  # noqa: F401  (defined with the batch whose padding it is)

ROUTING_DTYPE = torch.int16
MAX_EXPERTS = torch.iinfo(ROUTING_DTYPE).max + 1  # expert ids 0..32767


def empty_records(shape: tuple, layers: int, k: int) -> torch.Tensor:
    """``shape + (layers, k)`` records holding no record anywhere."""
    return torch.full(tuple(shape) + (layers, k), NO_RECORD, dtype=ROUTING_DTYPE)


def to_records(indices: torch.Tensor) -> torch.Tensor:
    """Router indices (int64 from torch.topk) as record entries (int16, on CPU)."""
    if indices.numel() and int(indices.max()) >= MAX_EXPERTS:
        raise ValueError(f"expert index {int(indices.max())} does not fit in int16 routing records "
                         f"(at most {MAX_EXPERTS} experts)")
    return indices.to(device="cpu", dtype=ROUTING_DTYPE)


def has_record(records: torch.Tensor) -> torch.Tensor:
    """``records[..., k]`` -> bool ``[...]``: True where the k entries are a real top-k
    (all >= 0 and pairwise distinct)."""
    r = records.long()
    ok = (r >= 0).all(-1)
    k = r.shape[-1]
    if k > 1:
        s = r.sort(-1).values
        ok = ok & (s[..., 1:] != s[..., :-1]).all(-1)
    return ok
