"""Model tensors out of a DCP checkpoint, into safetensors: only the ``model.*`` entries are
read (never the optimizer state), one output shard at a time, so peak memory is about one
shard in the checkpoint's dtype (one model copy when the export is a single file).

DCP reassembles each full tensor from however many ranks wrote it (FSDP2 of any world size;
Megatron checkpoints already hold full tensors under Hugging Face names), so the same reader
serves every backend. Shard boundaries and the index come from huggingface_hub's
``split_torch_state_dict_into_shards`` (computed on meta tensors: no memory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint.shape_diff import shape_diff
from engine.errors import CheckpointError

MODEL_PREFIX = "model."
DEFAULT_MAX_SHARD_SIZE = "5GB"


@dataclass
class TensorPlan:
    names: dict[str, str]            # output name -> checkpoint key (without the "model." prefix)
    shapes: dict[str, torch.Size]    # output name -> shape
    source_dtypes: dict[str, torch.dtype]


def checkpoint_model_entries(state_dir: Path) -> dict[str, object]:
    """Checkpoint key (prefix stripped) -> DCP TensorStorageMetadata, for model entries only."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from engine.checkpoint.safe_dcp import safe_reader

    meta = safe_reader(state_dir).read_metadata()  # never pickle.load (engine/checkpoint/safe_dcp.py)
    return {k[len(MODEL_PREFIX):]: v for k, v in meta.state_dict_metadata.items()
            if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}


def expected_tensors(config) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """(name -> shape of every tensor save_pretrained writes, tied alias -> the name it shares),
    from the model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    first: dict[int, str] = {}
    shapes: dict[str, torch.Size] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        shapes[name] = t.shape
    return shapes, aliases


def plan_tensors(config, entries: dict[str, object], where: Path) -> TensorPlan:
    """Match the checkpoint's model entries to the tensors the architecture saves; refuse on
    anything missing or of the wrong shape (a checkpoint of another model)."""
    shapes, aliases = expected_tensors(config)
    diff = shape_diff(shapes, {n: tuple(e.size) for n, e in entries.items()}, set(aliases))
    missing, unknown = diff.missing, diff.unknown
    wrong = [f"{n} {have} vs {want}" for n, have, want in diff.wrong]
    if diff:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors ({', '.join(missing[:4])})")
        if unknown:
            parts.append(f"{len(unknown)} tensors the model does not have ({', '.join(unknown[:4])})")
        if wrong:
            parts.append(f"shape mismatches ({'; '.join(wrong[:3])})")
        raise CheckpointError(f"the model entries of {where} do not match {config.model_type} as configured: "
                              f"{', '.join(parts)}. The checkpoint belongs to another model or is damaged.",
                              title="checkpoint does not match model")
    return TensorPlan({n: n for n in shapes}, dict(shapes), {n: entries[n].properties.dtype for n in shapes})


def load_entries(state_dir: Path, keys: list[str], source_dtypes: dict[str, torch.dtype],
                 shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full tensors for ``keys`` (checkpoint keys without the prefix); nothing else is read."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from engine.checkpoint.safe_dcp import SafeLoadPlanner, safe_reader

    sd = {k: torch.empty(shapes[k], dtype=source_dtypes[k]) for k in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": sd}, storage_reader=safe_reader(state_dir), planner=SafeLoadPlanner(), no_dist=True)
    return sd


def write_safetensors(state_dir: Path, plan: TensorPlan, dtype: torch.dtype, out_dir: Path,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                      tensors_of=None) -> tuple[list[str], bool, int]:
    """Write model*.safetensors (+ index when sharded). ``tensors_of(names) -> {name: tensor}``
    overrides where tensors come from (LoRA merge); default: the DCP checkpoint. Returns
    (file names, sharded, parameters written)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    meta = {n: torch.empty(s, dtype=dtype, device="meta") for n, s in plan.shapes.items()}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    written, params = [], 0
    for filename, names in split.filename_to_tensors.items():
        if tensors_of is None:
            keys = [plan.names[n] for n in names]
            loaded = load_entries(state_dir, keys, plan.source_dtypes, plan.shapes)
            shard = {n: loaded.pop(plan.names[n]) for n in names}
        else:
            shard = tensors_of(names)
        for n in names:  # convert one tensor at a time: the source copy of each is freed as we go
            shard[n] = shard[n].to(dtype).contiguous()
            params += shard[n].numel()
        save_file(shard, str(out_dir / filename), metadata={"format": "pt"})
        written.append(filename)
        del shard
    if split.is_sharded:
        index = {"metadata": {**split.metadata, "total_parameters": params},
                 "weight_map": split.tensor_to_filename}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append("model.safetensors.index.json")
    return written, split.is_sharded, params
