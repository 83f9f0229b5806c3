"""Build the policy as a transformers causal LM: from a local HF directory or the tiny
built-in Llama-style config (random init, fully offline)."""

from __future__ import annotations

import torch

from engine.config.schema import ModelConfig, TaskConfig
from engine.errors import ConfigError


def tiny_hf_config(cfg: ModelConfig, vocab_size: int, pad_token_id: int = 0, eos_token_id: int = 1):
    from transformers import LlamaConfig, Qwen2Config

    if cfg.num_attention_heads % cfg.num_key_value_heads or cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size ({cfg.hidden_size}) must divide by model.num_attention_heads "
            f"({cfg.num_attention_heads}), which must divide by model.num_key_value_heads ({cfg.num_key_value_heads}).",
            title="invalid config value")
    common = dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
                  tie_word_embeddings=cfg.tie_word_embeddings, pad_token_id=pad_token_id,
                  eos_token_id=eos_token_id, bos_token_id=None, rms_norm_eps=1e-6, rope_theta=10000.0)
    if cfg.attention_bias:  # Qwen2: bias on q/k/v only
        return Qwen2Config(**common)
    return LlamaConfig(**common, attention_bias=False, mlp_bias=False)


def build_hf_model(cfg: ModelConfig, path: str, vocab_size: int, seed: int,
                   pad_token_id: int = 0, eos_token_id: int = 1, load_dtype: torch.dtype | None = None,
                   on_meta: bool = False) -> torch.nn.Module:
    """The policy on CPU in cfg.dtype. ``path`` empty -> tiny random init seeded by ``seed``.
    ``load_dtype``: read a checkpoint's weights straight into this dtype instead (the FSDP engine's
    fp32 masters: the same values as loading cfg.dtype and upcasting, without holding both copies
    on the host at once). A random init is always made in cfg.dtype (its values depend on it).
    ``on_meta``: the same modules on the meta device, without values (nothing read or allocated;
    engine/backends/fsdp/rank0_weights.py fills them)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)
    if on_meta:
        if path:
            from transformers import AutoConfig

            from engine.model.source import HF_LOAD_KWARGS

            dtype = load_dtype or dtype
            hf_cfg = AutoConfig.from_pretrained(path, **HF_LOAD_KWARGS)
        else:
            hf_cfg = tiny_hf_config(cfg, vocab_size, pad_token_id, eos_token_id)
        hf_cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    elif path:
        dtype = load_dtype or dtype
        from engine.model.source import HF_LOAD_KWARGS

        import pickle

        from engine.errors import ConfigError

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                         **HF_LOAD_KWARGS)
        except pickle.UnpicklingError as e:  # weights_only=True refused a global: never run, named here
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "GLOBAL" in ln), lines[0] if lines else type(e).__name__)
            raise ConfigError(f"{path}: its pickled weights need more than tensors to load ({why[:300]}); refused "
                              f"without running them. Convert weights you trust to safetensors "
                              f"(model.save_pretrained(dir)).", title="unsafe model") from None
    else:
        hf_cfg = tiny_hf_config(cfg, vocab_size, pad_token_id, eos_token_id)
        hf_cfg._attn_implementation = "sdpa"
        devrng = torch.random.fork_rng()
        with devrng:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    model.config.use_cache = True
    train_pad_embedding(model)
    return model


def train_pad_embedding(model: torch.nn.Module) -> None:
    """Give the pad token's embedding row its gradient. transformers builds the input embedding
    with ``padding_idx=pad_token_id``, which freezes that row; but a policy can sample the pad
    token as a real response token (a random-init policy does, often), and then its policy
    gradient belongs to that row like any other. Padding itself never reaches the loss (masked in
    attention and in the loss), so the row gets gradient only from real uses -- exactly what
    megatron's embedding, which has no padding_idx, computes: both engines now train the same
    model. (With a tied head the frozen row also froze the pad token's output logit.)"""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "padding_idx", None) is not None:
        emb.padding_idx = None
