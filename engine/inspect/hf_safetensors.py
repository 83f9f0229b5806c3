"""Reader for Hugging Face safetensors checkpoints: one file, or a directory (sharded or not).

A safetensors file starts with an 8-byte little-endian header length and a JSON header
naming every tensor's dtype, shape and byte range; only that header is read. A sharded
directory has ``model.safetensors.index.json`` whose ``weight_map`` says which shard holds
which tensor; every shard it names must exist and hold those tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.errors import CheckpointError
from engine.checkpoint.io.dtypes import SAFETENSORS_DTYPES
from engine.checkpoint.io.files import list_files, read_json
from engine.checkpoint.io.safetensors import read_header
from engine.inspect.report import CheckpointReport, TensorInfo

def is_safetensors_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")))


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
