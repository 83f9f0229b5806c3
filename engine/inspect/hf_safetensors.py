"""Reader for Hugging Face safetensors checkpoints: one file, or a directory (sharded or not).

A safetensors file starts with an 8-byte little-endian header length and a JSON header
naming every tensor's dtype, shape and byte range; only that header is read. A sharded
directory has ``model.safetensors.index.json`` whose ``weight_map`` says which shard holds
which tensor; every shard it names must exist and hold those tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

from engine import json_safe
from engine.errors import CheckpointError
from engine.checkpoint.io.dtypes import SAFETENSORS_DTYPES
from engine.checkpoint.io.files import human_bytes, list_files, read_json
from engine.inspect.report import CheckpointReport, TensorInfo

MAX_HEADER = 100 * 1024 * 1024  # the safetensors library refuses larger headers too


def is_safetensors_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")))


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


def _tensor(name: str, e: dict) -> TensorInfo:
    code = str(e.get("dtype", "?"))
    return TensorInfo(name=name, dtype=SAFETENSORS_DTYPES.get(code, code.lower()),
                      shape=tuple(int(d) for d in e.get("shape", ())), group="model")


def inspect_safetensors(path: Path, *, display: Optional[str] = None) -> CheckpointReport:
    """Report for a ``.safetensors`` file or a directory of them (with or without index)."""
    shown = display or str(path)
    if path.is_file():
        header, meta = read_header(path, display=shown)
        rep = CheckpointReport(path=shown, format="safetensors",
                               format_detail="single safetensors file",
                               files=list_files(path),
                               tensors=[_tensor(k, v) for k, v in header.items()])
        if meta:
            rep.info["metadata"] = meta
        return rep

    indexes = sorted(path.glob("*.safetensors.index.json"))
    rep = CheckpointReport(path=shown, format="safetensors", files=list_files(path))
    problems: list[str] = []
    if indexes:
        index_path = indexes[0]
        index = read_json(index_path, what=index_path.name)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{shown}/{index_path.name} has no weight_map; the index is "
                                  "corrupt.", title="corrupt checkpoint")
        shards = sorted(set(weight_map.values()))
        rep.format_detail = f"Hugging Face safetensors, {len(shards)} shard(s) via {index_path.name}"
        rep.info["index"] = index_path.name
        if isinstance(index.get("metadata"), dict):
            rep.info["index_metadata"] = index["metadata"]
        seen: dict[str, TensorInfo] = {}
        for shard in shards:
            sp = path / shard
            if not sp.is_file():
                problems.append(f"shard {shard} is missing "
                                f"({sum(1 for v in weight_map.values() if v == shard)} tensors)")
                continue
            header, _ = read_header(sp, display=f"{shown}/{shard}")
            for name, e in header.items():
                seen[name] = _tensor(name, e)
            for name in (k for k, v in weight_map.items() if v == shard):
                if name not in header:
                    problems.append(f"{name} is mapped to {shard} but not in it")
        extra = sorted(set(seen) - set(weight_map))
        if extra:
            rep.notes.append(f"{len(extra)} tensor(s) in shards but not in the index, e.g. {extra[0]}")
        rep.tensors = list(seen.values())
        if len(indexes) > 1:
            rep.notes.append(f"{len(indexes)} index files; read {index_path.name}")
    else:
        files = sorted(path.glob("*.safetensors"))
        rep.format_detail = f"Hugging Face safetensors, {len(files)} file(s), no index"
        for fp in files:
            header, meta = read_header(fp, display=f"{shown}/{fp.name}")
            rep.tensors.extend(_tensor(k, v) for k, v in header.items())
            if meta and "metadata" not in rep.info:
                rep.info["metadata"] = meta
    if problems:
        raise CheckpointError(f"{shown} is incomplete: " + "; ".join(problems) +
                              ". Download or copy the missing shards again.",
                              title="incomplete checkpoint")
    cfg_path = path / "config.json"
    if cfg_path.is_file():
        cfg = read_json(cfg_path, what="config.json")
        if isinstance(cfg, dict):
            rep.config = cfg
            if cfg.get("transformers_version"):
                rep.versions["transformers"] = str(cfg["transformers_version"])
            for k in ("model_type", "architectures", "torch_dtype", "dtype"):
                if k in cfg:
                    rep.info[k] = cfg[k]
    return rep
