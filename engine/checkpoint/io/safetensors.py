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
        try:
            end = max(end, int(e["data_offsets"][1]))
        except (KeyError, TypeError, IndexError, ValueError):
            raise CheckpointError(f"{shown}: header entry {name!r} has no valid data_offsets; "
                                  "the file is corrupt.", title="corrupt checkpoint") from None
    if end > data_len:
        raise CheckpointError(
            f"{shown} is truncated: the header places tensor data up to byte {end:,} of the "
            f"data section, which is only {human_bytes(data_len)} ({data_len:,} bytes). Copy "
            "it again or download it again.", title="corrupt checkpoint")
    return header, meta
