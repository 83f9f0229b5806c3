"""Split a SequenceBatch into micro-batches and pad each one to a bucket length.

Two layouts, one bucket policy (engine/batching/buckets.py):

``padded`` (BSHD): each micro-batch is rows [b, T]; T is the bucket of its longest row. Rows are
    sorted by length (longest first, ties by row index) and taken greedily, so each micro-batch
    holds rows of similar length. Token budget mode (``engine.micro_batch_size == 0``): a
    micro-batch of bucket T holds ``max_tokens_per_micro_batch // T`` rows, so b*T (padded tokens)
    stays within the budget and b is a function of T: one shape per bucket, plus the last, partial
    micro-batch of a batch. ``pad_rows=True`` fills that one with empty rows (attention and
    response masks 0) so that every shape is (rows(T), T), for backends that need static shapes.
``packed`` (THD, "remove padding"): each micro-batch is its sequences concatenated into [1, N]
    with position ids restarting at 0 per sequence; N is padded to its bucket by one suffix pad
    segment (positions 0.., its own sequence in ``cu_seqlens``). Sequences go into micro-batches
    by first-fit-decreasing under the token budget, so most micro-batches are nearly full and one
    is a remainder. Hugging Face models treat position ids that restart as separate sequences
    when no attention_mask is passed (block-diagonal causal attention).

Padding never reaches the loss, log-probs, entropy or values: it is a suffix with
attention_mask 0 and response_mask 0 (padded), or a separate sequence that ``unpack`` drops
(packed). ``MicroBatch.indices`` maps rows back to the original batch; ``scatter_back`` does
that for a list of per-micro-batch outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from engine.batch import SequenceBatch, pad_fill, pad_tokens
from engine.batching.buckets import BucketPolicy, make_bucket_policy

LAYOUTS = ("padded", "packed")


@dataclass
class PackedInputs:
    """One packed micro-batch: sequences concatenated into [1, N], then the pad segment.

    input_ids / position_ids  [1, N] long; position ids restart at 0 for every sequence and for
                              the pad segment
    cu_seqlens                [s + 1] int32 boundaries of the s segments (the b sequences, then
                              the pad segment if there is one), as flash-attn varlen expects
    seq_lengths               [b] long, real lengths, in the row order of ``MicroBatch.batch``
    num_pad                   tokens in the pad segment
    routed_experts            [1, N, L, k] int16 routing records packed like input_ids (the pad
                              segment holds no record), when the batch carries them
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lengths: torch.Tensor
    num_pad: int
    _rows: torch.Tensor
    _cols: torch.Tensor
    _flat: torch.Tensor
    _width: int
    routed_experts: Optional[torch.Tensor] = None

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] or [N, ...] per-token values -> [b, T, ...] right-padded with zeros.

        T is the longest row of the micro-batch (``MicroBatch.batch.input_ids.shape[1]``); the
        pad segment is dropped.
        """
        if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == self.input_ids.shape[1]:
            values = values[0]
        out = values.new_zeros((len(self.seq_lengths), self._width) + tuple(values.shape[1:]))
        out[self._rows, self._cols] = values[self._flat]
        return out


@dataclass
class MicroBatch:
    """One forward/backward's worth of rows.

    batch          rows of this micro-batch (padded layout: right-padded to the bucket length,
                   plus empty rows at the end when pad_rows; packed layout: trimmed to its
                   longest row, the model input is ``packed``)
    indices        [num_rows] long: row i of ``batch`` is row indices[i] of the original batch
    real_tokens    tokens with attention_mask 1
    natural_tokens tokens this micro-batch would take without bucket padding (b * longest row
                   padded; sum of lengths packed): padded - natural = what the bucket added
    padded_tokens  tokens the model actually processes (product of ``shape``)
    shape          the model input's shape: (b, T) padded, (1, N) packed
    packed         PackedInputs in the packed layout, else None
    """

    batch: SequenceBatch
    indices: torch.Tensor
    real_tokens: int
    natural_tokens: int
    padded_tokens: int
    shape: tuple
    packed: Optional[PackedInputs] = None

    @property
    def num_rows(self) -> int:
        """Rows from the original batch (``batch`` may hold more: empty padding rows)."""
        return int(self.indices.numel())


def _token_budget(engine_cfg) -> Optional[int]:
    return None if engine_cfg.micro_batch_size > 0 else int(engine_cfg.max_tokens_per_micro_batch)


def _split_largest(groups: list[list[int]], weight, minimum: int) -> list[list[int]]:
    """Split the heaviest group in two (first half / second half) until there are ``minimum``."""
    groups = [list(g) for g in groups]
    while len(groups) < minimum:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: (weight(groups[i]), -i))
        g = groups.pop(i)
        half = (len(g) + 1) // 2
        groups[i:i] = [g[:half], g[half:]]
    return groups


def _group_padded(lengths: list[int], order: list[int], engine_cfg, policy: BucketPolicy) -> list[list[int]]:
    budget = _token_budget(engine_cfg)
    groups, pos = [], 0
    while pos < len(order):
        t = policy.bucket_length(lengths[order[pos]])
        cap = engine_cfg.micro_batch_size if budget is None else max(1, budget // t)
        groups.append(order[pos: pos + cap])
        pos += cap
    return groups


def _group_packed(lengths: list[int], order: list[int], engine_cfg, policy: BucketPolicy) -> list[list[int]]:
    budget = _token_budget(engine_cfg)
    if budget is None:
        # fixed rows per micro-batch: deal sorted rows out in a snake so totals are balanced
        m = math.ceil(len(order) / engine_cfg.micro_batch_size)
        groups = [[] for _ in range(m)]
        for rank, row in enumerate(order):
            lap, pos = divmod(rank, m)
            groups[pos if lap % 2 == 0 else m - 1 - pos].append(row)
        return groups

    def fits(total: int) -> bool:
        return total <= policy.max_length and policy.bucket_length(total) <= budget

    bins: list[list] = []  # [total, rows]
    for row in order:  # first-fit decreasing
        n = lengths[row]
        for b in bins:
            if fits(b[0] + n):
                b[0] += n
                b[1].append(row)
                break
        else:
            bins.append([n, [row]])
    return [b[1] for b in bins]


def _pad_columns(batch: SequenceBatch, width: int, rows: int, pad_token_id: int) -> SequenceBatch:
    """Right-pad every [b, T, ...] tensor to [rows, width, ...]; new entries are pad_token_id
    (input_ids), no record (routed_experts) or 0."""
    out = {}
    for name in batch.tensor_fields():
        v = getattr(batch, name)
        fill = pad_fill(name, pad_token_id)
        if v.dim() >= 2:
            v = pad_tokens(v, width, fill)
        if v.shape[0] < rows:
            extra = v.new_full((rows - v.shape[0],) + tuple(v.shape[1:]), fill)
            v = torch.cat([v, extra], 0)
        out[name] = v
    return SequenceBatch(**out, extras=dict(batch.extras))


def _pack(batch: SequenceBatch, lengths: list[int], total: int, pad_token_id: int) -> PackedInputs:
    ids, pos, rows, cols = [], [], [], []
    for r, n in enumerate(lengths):
        ids.append(batch.input_ids[r, :n])
        pos.append(torch.arange(n))
        rows.append(torch.full((n,), r, dtype=torch.long))
        cols.append(torch.arange(n))
    real = sum(lengths)
    num_pad = total - real
    if num_pad:
        ids.append(torch.full((num_pad,), pad_token_id, dtype=batch.input_ids.dtype))
        pos.append(torch.arange(num_pad))
    routing = None
    if batch.routed_experts is not None:
        parts = [batch.routed_experts[r, :n] for r, n in enumerate(lengths)]
        if num_pad:
            parts.append(parts[0].new_full((num_pad,) + tuple(parts[0].shape[1:]), pad_fill("routed_experts")))
        routing = torch.cat(parts)[None]
    seg = list(lengths) + ([num_pad] if num_pad else [])
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg, dtype=torch.int32), 0)
    return PackedInputs(
        input_ids=torch.cat(ids)[None], position_ids=torch.cat(pos)[None], cu_seqlens=cu,
        seq_lengths=torch.tensor(lengths, dtype=torch.long), num_pad=num_pad,
        _rows=torch.cat(rows), _cols=torch.cat(cols), _flat=torch.arange(real),
        _width=int(batch.input_ids.shape[1]), routed_experts=routing)


def split_micro_batches(batch: SequenceBatch, engine_cfg, policy: Optional[BucketPolicy] = None,
                        pad_token_id: int = 0, *, layout: str = "padded", pad_rows: bool = False,
                        min_micro_batches: int = 1, observe: bool = True) -> list[MicroBatch]:
    """Micro-batches of ``batch`` under ``engine.micro_batch_size`` or the token budget
    ``engine.max_tokens_per_micro_batch`` (padded tokens counted), each padded to its bucket.

    policy             None: make_bucket_policy(engine_cfg) (only the hard alignment when
                       pad_to_length is off). Pass the engine's long-lived policy so that
                       policy=learned sees every step.
    layout             "padded" ([b, T]) or "packed" ([1, N]); see the module doc.
    pad_rows           padded layout: fill the last, partial micro-batch with empty rows so its
                       shape is the same as a full one (static-shape backends).
    min_micro_batches  at least this many (split the heaviest until reached): data-parallel
                       ranks that must run the same number of forward/backward passes agree on
                       the max of their counts and pass it here.
    observe            report natural lengths to the policy (turn off for repeated passes over
                       the same data, e.g. reference log-probs).
    The split is deterministic: it depends only on the row lengths, their order and the policy.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if len(batch) < min_micro_batches:
        raise ValueError(f"{len(batch)} rows cannot make {min_micro_batches} micro-batches")
    policy = make_bucket_policy(engine_cfg) if policy is None else policy
    lengths = [int(n) for n in batch.seq_lengths.tolist()]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    if layout == "padded":
        groups = _group_padded(lengths, order, engine_cfg, policy)
        groups = _split_largest(groups, len, min_micro_batches)
    else:
        groups = _group_packed(lengths, order, engine_cfg, policy)
        groups = _split_largest(groups, lambda g: sum(lengths[i] for i in g), min_micro_batches)

    out, natural = [], []
    for group in groups:
        rows = sorted(group)
        idx = torch.tensor(rows, dtype=torch.long)
        sub = batch.select(idx)
        lens = [lengths[i] for i in rows]
        real = sum(lens)
        if layout == "padded":
            n = max(lens)
            t = policy.bucket_length(n)
            b = len(rows)
            if pad_rows:
                cap = engine_cfg.micro_batch_size
                if cap <= 0:
                    cap = max(1, int(engine_cfg.max_tokens_per_micro_batch) // t)
                b = max(b, cap)
            padded = _pad_columns(sub, t, b, pad_token_id)
            out.append(MicroBatch(padded, idx, real, len(rows) * n, b * t, (b, t)))
            natural.append((n, len(rows)))
        else:
            total = policy.bucket_length(real)
            packed = _pack(sub, lens, total, pad_token_id)
            out.append(MicroBatch(sub, idx, real, real, total, (1, total), packed))
            natural.append((real, 1))
    if observe:
        policy.observe([n for n, _ in natural], [w for _, w in natural])
    return out


def scatter_back(micro_batches: list[MicroBatch], outputs: list[torch.Tensor], num_rows: int,
                 width: int) -> torch.Tensor:
    """Per-micro-batch row outputs ([rows, T_mb, ...], packed ones already ``unpack``ed) -> one
    [num_rows, width, ...] tensor in the original row order; empty padding rows and columns
    beyond ``width`` are dropped, positions no micro-batch covers are 0."""
    first = outputs[0]
    out = first.new_zeros((num_rows, width) + tuple(first.shape[2:]))
    for mb, values in zip(micro_batches, outputs):
        w = min(width, values.shape[1])
        out[mb.indices, :w] = values[: mb.num_rows, :w].to(out.dtype)
    return out


def pad_stats(micro_batches: list[MicroBatch]) -> dict:
    """Padding and shape figures for a list of micro-batches (one step, or a whole run).

    pad_fraction         (padded - real) / padded: every token the model computes for nothing
    bucket_pad_fraction  (padded - natural) / padded: the part the bucket added (the rest, in the
                         padded layout, is rows shorter than the longest in their micro-batch)
    distinct_shapes      how many different model-input shapes (what torch.compile, CUDA graphs
                         and cuDNN plan per)
    """
    real = sum(mb.real_tokens for mb in micro_batches)
    natural = sum(mb.natural_tokens for mb in micro_batches)
    padded = sum(mb.padded_tokens for mb in micro_batches)
    shapes = sorted({tuple(mb.shape) for mb in micro_batches})
    return {
        "micro_batches": len(micro_batches),
        "real_tokens": real,
        "natural_tokens": natural,
        "padded_tokens": padded,
        "pad_fraction": (padded - real) / padded if padded else 0.0,
        "bucket_pad_fraction": (padded - natural) / padded if padded else 0.0,
        "distinct_shapes": len(shapes),
        "shapes": shapes,
    }


def zero_weight_twin(mb: MicroBatch) -> MicroBatch:
    """A copy of ``mb`` whose rows count for nothing (loss and metrics 0), indices -1: what a rank
    with fewer rows runs so that ranks whose forwards hold collectives run as many of them."""
    b = mb.batch
    out = {n: getattr(b, n).clone() for n in b.tensor_fields()}
    out["response_mask"] = torch.zeros_like(out["response_mask"])
    return replace(mb, batch=SequenceBatch(**out, extras=b.extras), indices=torch.full_like(mb.indices, -1),
                   real_tokens=0, padded_tokens=0)


def pad_micro_batch(mb: MicroBatch, rows: int, width: int, pad_token_id: int) -> MicroBatch:
    """``mb`` (padded layout) widened to ``[rows, width]`` with empty rows and pad columns: the
    shape agreed with ranks whose forwards exchange tokens (megatron's MoE all-gather)."""
    if (rows, width) == tuple(mb.batch.input_ids.shape):
        return mb
    padded = _pad_columns(mb.batch, width, rows, pad_token_id)
    return replace(mb, batch=padded, padded_tokens=rows * width if mb.padded_tokens else 0, shape=(rows, width))
