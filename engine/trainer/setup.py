"""Everything the driver prepares before ranks start: task, tokenizer, encoded prompts."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.schema import RunConfig
from engine.errors import ConfigError
from engine.tasks.base import Task


@dataclass
class RunInputs:
    task: Task
    tokenizer: object
    train_prompts: list[list[int]]
    val_prompts: list[list[int]]
    model_path: str
    vocab: dict      # {"size", "pad", "eos"}


def resolve_model_path(cfg: RunConfig) -> str:
    if cfg.model.path:
        return cfg.model.path
    if cfg.model.preset == "tiny":
        return ""
    from engine.model.presets import resolve_model_path as resolve_preset
    return resolve_preset(cfg.model)


def prepare_inputs(cfg: RunConfig) -> RunInputs:
    from engine.model.tokenizer import CharTokenizer, HFTokenizer, encode_prompt
    from engine.tasks.registry import make_task

    task = make_task(cfg.task, cfg.trainer.seed)
    model_path = resolve_model_path(cfg)
    if model_path:
        tok = HFTokenizer(model_path, chat_template=cfg.task.chat_template)
    else:
        if not task.alphabet:
            raise ConfigError(f"task={cfg.task.name} needs a real tokenizer: set model.path=/path/to/hf-model "
                              f"or a model preset (e.g. model=smollm2-135m).", title="invalid config")
        tok = CharTokenizer(task.alphabet)
    train = [encode_prompt(tok, e.prompt) for e in task.train]
    val = [encode_prompt(tok, e.prompt) for e in task.val]
    too_long = [len(p) for p in train + val if len(p) > cfg.data.max_prompt_length]
    if too_long:
        raise ConfigError(f"{len(too_long)} prompts are longer than data.max_prompt_length="
                          f"{cfg.data.max_prompt_length} tokens (longest {max(too_long)}). Raise "
                          f"data.max_prompt_length or shorten the prompts.", title="invalid config")
    limit = cfg.model.max_position_embeddings if not model_path else None
    if limit and cfg.data.max_prompt_length + cfg.rollout.max_new_tokens > limit:
        longest = max(len(p) for p in train + val)
        if longest + cfg.rollout.max_new_tokens > limit:
            raise ConfigError(f"prompt ({longest}) + rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) exceeds "
                              f"model.max_position_embeddings ({limit}).", title="invalid config")
    vocab = {"size": tok.vocab_size, "pad": tok.pad_token_id, "eos": tok.eos_token_id}
    if cfg.rollout.name == "vllm":  # refuse what vLLM would get wrong, before any rank starts
        from engine.rollout.vllm_sampler import check_vllm_config, head_dim_of, hf_config_for

        check_vllm_config(cfg, head_dim_of(hf_config_for(cfg, model_path, vocab)))
    return RunInputs(task, tok, train, val, model_path, vocab)
