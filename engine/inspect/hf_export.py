"""Hugging Face directories `rl export` writes: a full model (``rl_export.json`` beside
config.json and the safetensors) and a PEFT LoRA adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``, from `rl export --adapter` or any peft ``save_pretrained``).
Both are read as safetensors directories, plus what their side files say."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.checkpoint.io.files import read_json
from engine.inspect.hf_safetensors import inspect_safetensors
from engine.inspect.report import CheckpointReport

EXPORT_MARKER = "rl_export.json"
ADAPTER_CONFIG = "adapter_config.json"


def is_rl_export(path: Path) -> bool:
    return path.is_dir() and (path / EXPORT_MARKER).is_file() and not (path / ADAPTER_CONFIG).is_file()


def is_peft_adapter(path: Path) -> bool:
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file() and any(path.glob("adapter_model.*"))


def inspect_rl_export(path: Path, *, display: Optional[str] = None) -> CheckpointReport:
    rep = inspect_safetensors(path, display=display)
    rep.format = "rl-export"
    marker = read_json(path / EXPORT_MARKER, what=EXPORT_MARKER)
    if isinstance(marker, dict):
        rep.step = marker.get("step")
        rep.world_size = marker.get("world_size")
        rep.layout = marker.get("parallel") or {}
        rep.format_detail = (f"Hugging Face model exported by `rl export` ({marker.get('kind')}, "
                             f"{marker.get('dtype')}) from {marker.get('source')}; " + rep.format_detail)
        rep.info["export"] = marker
    return rep


def inspect_peft_adapter(path: Path, *, display: Optional[str] = None) -> CheckpointReport:
    rep = inspect_safetensors(path, display=display)
    rep.format = "peft-adapter"
    cfg = read_json(path / ADAPTER_CONFIG, what=ADAPTER_CONFIG)
    if isinstance(cfg, dict):
        rep.format_detail = (f"PEFT {cfg.get('peft_type', 'LORA')} adapter (r={cfg.get('r')}, "
                             f"alpha={cfg.get('lora_alpha')}, targets {cfg.get('target_modules')}) for base "
                             f"{cfg.get('base_model_name_or_path') or '?'}; " + rep.format_detail)
        rep.info["adapter_config"] = {k: cfg.get(k) for k in ("peft_type", "r", "lora_alpha", "lora_dropout",
                                                             "target_modules", "base_model_name_or_path")}
    if (path / EXPORT_MARKER).is_file():
        rep.info["export"] = read_json(path / EXPORT_MARKER, what=EXPORT_MARKER)
    return rep
