"""The files of an export that do not come from the checkpoint's tensors: the model config,
generation config and tokenizer of the model the run trained, rebuilt from the manifest.

* ``model.path`` / a preset: the resolved local directory recorded in the manifest
  (``model.resolved_path``), else resolved again (a hub id from the local HF cache).
* the tiny built-in model: ``tiny_hf_config`` from the recorded ``model.*`` dims and the
  task's character vocabulary as a real ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.errors import CheckpointError, UserError


@dataclass
class BaseModel:
    config: object               # transformers PretrainedConfig
    generation_config: object    # transformers GenerationConfig
    tokenizer: object            # has save_pretrained(dir)
    source: str                  # "tiny built-in (...)" or the directory it came from
    path: str                    # the local directory ("" for the tiny model)


def run_config(manifest_config: dict):
    from engine.config.validate import build_run_config

    try:
        return build_run_config(manifest_config, check_environment=False)  # read, not run: loggers need nothing
    except Exception as e:  # a checkpoint from an older schema
        raise CheckpointError(f"the checkpoint's recorded config no longer validates ({e}); export it with the "
                              f"rl version that wrote it (versions.json in the run directory).",
                              title="incompatible checkpoint") from None


def base_dir(manifest: dict, cfg) -> str:
    recorded = (manifest.get("model") or {}).get("resolved_path") or ""
    if recorded and os.path.isfile(os.path.join(recorded, "config.json")):
        return recorded
    if recorded and "/snapshots/" not in recorded.replace(os.sep, "/"):
        # a local directory, not a hub-cache snapshot: resolving model.path again would read it relative to
        # this shell's directory, and could find another model's config and tokenizer there
        raise UserError(f"The model directory this run trained from, {recorded} (the checkpoint's manifest: "
                        f"model.resolved_path), is gone or has no config.json; export takes the model's config and "
                        f"tokenizer from it. Put the model back at that path (or a symbolic link to a copy of it), "
                        f"and export again.", title="base model not found")
    from engine.model.presets import resolve_model_path

    return resolve_model_path(cfg.model)  # "" for tiny; ConfigError when it cannot be found


def architectures(config) -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    return [name] if isinstance(name, str) else list(getattr(config, "architectures", None) or [])


def load_base_model(manifest: dict) -> BaseModel:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    cfg = run_config(manifest.get("config") or {})
    path = base_dir(manifest, cfg)
    if path:
        from engine.model.source import HF_LOAD_KWARGS, check_architecture

        check_architecture(path)  # the manifest names it: no custom code, no pickled weights that run code
        config = AutoConfig.from_pretrained(path, **HF_LOAD_KWARGS)
        tokenizer = AutoTokenizer.from_pretrained(path, **HF_LOAD_KWARGS)
        try:
            gen = GenerationConfig.from_pretrained(path, local_files_only=True)  # JSON only, no code
        except OSError:
            gen = GenerationConfig.from_model_config(config)
        source = path
    else:
        from engine.model.build import tiny_hf_config
        from engine.model.tokenizer import CharTokenizer
        from engine.tasks.registry import make_task

        task = make_task(cfg.task, cfg.trainer.seed)
        char = CharTokenizer(task.alphabet)
        config = tiny_hf_config(cfg.model, char.vocab_size, char.pad_token_id, char.eos_token_id)
        tokenizer = char.hf()
        gen = GenerationConfig(eos_token_id=char.eos_token_id, pad_token_id=char.pad_token_id)
        source = f"tiny built-in ({config.model_type}, task={cfg.task.name} vocabulary)"
    config.architectures = architectures(config)
    config.use_cache = True
    return BaseModel(config, gen, tokenizer, source, path)
