"""Safe reader of a safetensors file's header: the 8-byte length, then the JSON header naming
every tensor's dtype, shape and byte range, checked against the file's size (a truncated copy is
refused). The tensors themselves are never read."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

from engine import json_safe
from engine.checkpoint.io.files import human_bytes
from engine.errors import CheckpointError

MAX_HEADER = 100 * 1024 * 1024  # the safetensors library refuses larger headers too

# bits per element of the safetensors dtypes (a dtype not listed here is not size-checked: a newer
# format's, which the loader judges)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
              "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def entry_problem(entry) -> str:
    """What is wrong with one tensor's header entry ("" if nothing): its dtype a string, its shape
    a list of non-negative integers, its data_offsets two integers 0 <= begin <= end whose span is
    the shape's size in that dtype. (A bad entry made `rl inspect-ckpt` raise on int('x') and the
    loaders fail deep inside a worker.)"""
    if not isinstance(entry, dict):
        return "is not a JSON object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return f"has dtype {dtype!r}, not a dtype name"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"has shape {shape!r}, not a list of non-negative integers"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}, not two integers 0 <= begin <= end"
    bits = DTYPE_BITS.get(dtype)
    numel = 1
    for d in shape:
        numel *= d
    if bits is not None and offsets[1] - offsets[0] != (numel * bits + 7) // 8:
        return (f"holds {offsets[1] - offsets[0]:,} bytes for a {dtype} tensor of shape {shape}, which needs "
                f"{(numel * bits + 7) // 8:,}")
    return ""


def read_header(path: Path, *, display: Optional[str] = None) -> tuple[dict, dict]:
    """(tensors: name -> {dtype, shape, data_offsets}, __metadata__) of one file.

    Raises CheckpointError if the header is unreadable or the data is shorter than the
    header says (a truncated copy).
    """
    shown = display or str(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{shown} is truncated: {size} bytes, shorter than a "
                                  "safetensors header.", title="corrupt checkpoint")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or n + 8 > size:
            raise CheckpointError(
                f"{shown} is truncated or not safetensors: its header claims {n:,} bytes but "
                f"the file has {size:,}.", title="corrupt checkpoint")
        raw = f.read(n)
    try:
        header = json_safe.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{shown}: the safetensors header is not valid JSON ({e}); the "
                              "file is corrupt.", title="corrupt checkpoint") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{shown}: the safetensors header is not a JSON object.",
                              title="corrupt checkpoint")
    meta = header.pop("__metadata__", None) or {}
    data_len = size - 8 - n
    end = 0
    for name, e in header.items():
        problem = entry_problem(e)
        if problem:
            raise CheckpointError(f"{shown}: header entry {name!r} {problem}; the file is corrupt. Copy it again "
                                  "or download it again.", title="corrupt checkpoint")
        end = max(end, e["data_offsets"][1])
    if end > data_len:
        raise CheckpointError(
            f"{shown} is truncated: the header places tensor data up to byte {end:,} of the "
            f"data section, which is only {human_bytes(data_len)} ({data_len:,} bytes). Copy "
            "it again or download it again.", title="corrupt checkpoint")
    return header, meta
