"""Which checkpoint format a path holds, decided from names and small side files only.

:func:`detect` returns the format key; :data:`READERS` maps it to the reader. The order
of checks matters: more specific layouts (an `rl` step holds a DCP dir) come first.
Anything unrecognised is a :class:`CheckpointError` listing what was found there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from engine.errors import CheckpointError
from engine.checkpoint.io.dcp import is_dcp_dir
from engine.inspect import dcp, hf_export, hf_safetensors, megatron_dist, rl_checkpoint, torch_save, verl_fsdp
from engine.checkpoint.io.files import human_bytes
from engine.checkpoint.io.safe_unpickle import ZIP_MAGIC

# format key -> (reader, what it is, for messages and --help)
READERS: dict[str, tuple[Callable, str]] = {
    "rl-run": (rl_checkpoint.inspect_rl_run,
               "rl run root (step_N/ directories)"),
    "rl": (rl_checkpoint.inspect_rl_step,
           "rl checkpoint (step_N/ with manifest.json, state/, rng/)"),
    "verl-run": (verl_fsdp.inspect_verl_run,
                 "verl save dir (latest_checkpointed_iteration.txt, global_step_N/)"),
    "verl-fsdp": (verl_fsdp.inspect_verl_step,
                  "verl FSDP checkpoint (actor/model_world_size_W_rank_R.pt)"),
    "megatron-run": (megatron_dist.inspect_megatron_run,
                     "Megatron save dir (latest_checkpointed_iteration.txt, iter_N/)"),
    "megatron": (megatron_dist.inspect_megatron,
                 "megatron-core dist_checkpointing dir (metadata.json + torch_dist)"),
    "dcp": (dcp.inspect_dcp,
            "torch.distributed.checkpoint dir (.metadata + *.distcp)"),
    "rl-export": (hf_export.inspect_rl_export,
                  "Hugging Face model written by `rl export` (rl_export.json + safetensors)"),
    "peft-adapter": (hf_export.inspect_peft_adapter,
                     "PEFT LoRA adapter dir (adapter_config.json + adapter_model.safetensors)"),
    "safetensors": (hf_safetensors.inspect_safetensors,
                    "Hugging Face safetensors (file, or dir with index)"),
    "torch-save": (torch_save.inspect_torch_save,
                   "torch.save file (zip archive)"),
}


def detect(path: Path) -> str:
    """The format key of ``path``; CheckpointError if missing or unrecognised."""
    from engine.user_paths import shown, stat_path

    if stat_path(path, f"the checkpoint path {shown(path)}", error=CheckpointError,
                 title="unreadable checkpoint") is None:
        raise CheckpointError(f"{shown(path)} does not exist. Pass a checkpoint directory or file "
                              "(e.g. ckpt/ or ckpt/step_40).", title="no such checkpoint")
    if path.is_file():
        return _detect_file(path)
    if not path.is_dir():  # a FIFO, a device (/dev/zero), a socket: never opened
        from engine.checkpoint.io.files import require_regular_file

        require_regular_file(path, str(path))
    if rl_checkpoint.is_rl_step(path):
        return "rl"
    if rl_checkpoint.is_rl_run(path):
        return "rl-run"
    if megatron_dist.is_megatron_dist(path):
        return "megatron"
    if megatron_dist.is_megatron_run(path):
        return "megatron-run"
    if verl_fsdp.is_verl_run(path):
        return "verl-run"
    if verl_fsdp.is_verl_step(path) or verl_fsdp.is_verl_component(path):
        return "verl-fsdp"
    if is_dcp_dir(path):
        return "dcp"
    if hf_export.is_peft_adapter(path):
        return "peft-adapter"
    if hf_export.is_rl_export(path):
        return "rl-export"
    if hf_safetensors.is_safetensors_dir(path):
        return "safetensors"
    raise CheckpointError(_unknown_dir_message(path), title="unknown checkpoint layout")


def _detect_file(path: Path) -> str:
    if path.name.endswith(".safetensors"):
        return "safetensors"
    if path.name.endswith(".safetensors.index.json"):
        raise CheckpointError(f"{path} is a safetensors index; pass its directory "
                              f"({path.parent}) to inspect all shards.", title="pass the directory")
    from engine.checkpoint.io.files import require_regular_file

    require_regular_file(path, str(path))
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        from engine.user_paths import os_problem

        raise CheckpointError(f"{path} {os_problem(e)}. Pass a checkpoint file you can read.",
                              title="unreadable checkpoint") from None
    if head[:4] == ZIP_MAGIC or path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return "torch-save"
    if path.name == ".metadata":
        raise CheckpointError(f"{path} is a DCP metadata file; pass its directory "
                              f"({path.parent}).", title="pass the directory")
    raise CheckpointError(
        f"{path} is not a checkpoint file rl inspect-ckpt knows ({human_bytes(path.stat().st_size)}, "
        f"starts with {head[:8]!r}). Known: " + "; ".join(d for _, d in READERS.values()) + ".",
        title="unknown checkpoint layout")


def _unknown_dir_message(path: Path, limit: int = 12) -> str:
    entries = sorted(path.iterdir(), key=lambda p: (not p.is_dir(), p.name))
    shown = []
    for p in entries[:limit]:
        if p.is_dir():
            try:
                n = sum(1 for _ in p.iterdir())
            except OSError:
                n = 0
            shown.append(f"{p.name}/ ({n} entries)")
        else:
            shown.append(f"{p.name} ({human_bytes(p.stat().st_size)})")
    found = ", ".join(shown) if shown else "nothing (the directory is empty)"
    if len(entries) > limit:
        found += f", and {len(entries) - limit} more"
    return (f"{path} is not a checkpoint layout rl inspect-ckpt recognises. Found: {found}. "
            "Known layouts: " + "; ".join(d for _, d in READERS.values()) + ". "
            "Pass the checkpoint directory itself (e.g. ckpt/step_40, global_step_40/actor).")
