"""Read a wandb offline run file (``run-<id>.wandb``) back into wandb's own protobuf records.

wandb >= 0.20 moved its Python reader into the Go core; the file is a LevelDB-style log
(header ":W&B" + magic 0xBEE1 + version 0, then 32 KiB blocks of records with a 7-byte header:
crc32, length, type FULL/FIRST/MIDDLE/LAST) holding ``wandb_internal_pb2.Record`` messages.
Used by tests only, to check what the logger wrote."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:7] == HEADER, data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:       # block trailer: too small for a header
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            payload = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        else:
            payload, pending = pending + chunk, b""
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def history(path: Path) -> list[dict]:
    """The history rows (one per logged step): {"_step": n, key: value, ...}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            row: dict = {}
            for i in rec.history.item:
                keys = [i.key] if i.key else list(i.nested_key)
                node = row
                for k in keys[:-1]:     # media (a wandb.Table) arrive as samples -> {_type, path, ...}
                    node = node.setdefault(k, {})
                node[keys[-1]] = json.loads(i.value_json)
            rows.append(row)
    return rows


def run_ids(path: Path) -> list[str]:
    return [rec.run.run_id for rec in records(path) if rec.WhichOneof("record_type") == "run"]
