"""LoRA checkpoints: they hold only the adapters (plus the base model's path and sha256 in the
manifest). Export rebuilds the base model, checks it is the one trained on, loads the
adapters into a ``peft.PeftModel`` and either merges them (``merge_and_unload``: a plain
transformers directory) or saves a PEFT adapter directory (``--adapter``)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.errors import CheckpointError
from engine.export.base_model import BaseModel, run_config
from engine.export.weights import TensorPlan, expected_tensors, load_entries, write_safetensors


def build_base(manifest: dict, base: BaseModel) -> torch.nn.Module:
    """The base model exactly as the FSDP engine built it before injecting adapters (fp32
    masters), verified against the checkpoint's sha256."""
    from engine.model.build import build_hf_model
    from engine.model.lora import state_dict_sha256

    cfg = run_config(manifest.get("config") or {})
    tok = base.tokenizer
    model = build_hf_model(cfg.model, base.path, len(tok), cfg.trainer.seed, tok.pad_token_id, tok.eos_token_id)
    if cfg.model.dtype != "float32":
        model = model.float()
    ref = manifest["model"]["lora"]
    digest = state_dict_sha256(model)
    if digest != ref.get("base_sha256"):
        raise CheckpointError(
            f"the base model this LoRA checkpoint was trained on has changed: {base.source} now hashes to "
            f"{digest[:16]}..., the checkpoint recorded {str(ref.get('base_sha256'))[:16]}... (base_path "
            f"{ref.get('base_path') or 'tiny built-in'}). Restore that base model to export the adapters "
            f"against it.", title="base model changed")
    return model


def peft_model_with_adapters(src, base: BaseModel, entries: dict):
    from peft import get_peft_model

    from engine.model.lora import ADAPTER, PEFT_PREFIX, peft_config

    cfg = run_config(src.config)
    model = build_base(src.manifest, base)
    peft = get_peft_model(model, peft_config(cfg.model.lora, model.config.model_type), adapter_name=ADAPTER)
    keys = sorted(entries)
    if not keys or not all("lora_" in k for k in keys):
        raise CheckpointError(f"{src.step_dir} says it is a LoRA checkpoint but its model entries are not "
                              f"adapters ({', '.join(keys[:3])}).", title="corrupt checkpoint")
    sd = load_entries(src.state_dir, keys, {k: entries[k].properties.dtype for k in keys},
                      {k: entries[k].size for k in keys})
    result = peft.load_state_dict({PEFT_PREFIX + k: v for k, v in sd.items()}, strict=False)
    wanted = {n for n, _ in peft.named_parameters() if "lora_" in n}
    missing = wanted - {PEFT_PREFIX + k for k in keys}
    if result.unexpected_keys or missing:
        raise CheckpointError(f"the adapters in {src.step_dir} do not fit the base model: missing "
                              f"{sorted(missing)[:3]}, unexpected {result.unexpected_keys[:3]}.",
                              title="checkpoint does not match model")
    return peft


def write_lora(src, base: BaseModel, entries: dict, dtype: torch.dtype, out: Path, adapter: bool,
               max_shard_size) -> tuple[str, int, bool, int, list[str]]:
    """(kind, tensors, sharded, parameters, files) after writing the weights into ``out``."""
    peft = peft_model_with_adapters(src, base, entries)
    if adapter:
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(dtype)
        peft.peft_config["default"].base_model_name_or_path = base.path or "tiny built-in (see rl_export.json)"
        peft.save_pretrained(str(out), safe_serialization=True)
        n = [p for name, p in peft.named_parameters() if "lora_" in name]
        files = sorted(p.name for p in out.iterdir())
        return "lora-adapter", len(n), False, sum(p.numel() for p in n), files
    merged = peft.merge_and_unload()
    sd = merged.state_dict()
    shapes, _aliases = expected_tensors(base.config)
    absent = [n for n in shapes if n not in sd]
    if absent:
        raise CheckpointError(f"merging the adapters left no tensor for {absent[:3]}.", title="export failed")
    plan = TensorPlan({n: n for n in shapes}, dict(shapes), {n: sd[n].dtype for n in shapes})
    files, sharded, params = write_safetensors(src.state_dir, plan, dtype, out, max_shard_size,
                                               tensors_of=lambda names: {n: sd[n] for n in names})
    return "merged-lora", len(shapes), sharded, params, files
