"""Tiny real Hugging Face model directories for tests, built offline from transformers configs
(random init, seeded) with the echo task's character tokenizer saved beside them, and a
real-layout Hugging Face hub cache that ``huggingface_hub`` resolves offline."""

from __future__ import annotations

from pathlib import Path

ARCHS = ("llama", "qwen2", "gpt2", "gpt_neox", "mistral")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def char_tokenizer():
    from engine.model.tokenizer import CharTokenizer
    from engine.tasks.registry import make_task
    from engine.config.schema import TaskConfig

    return CharTokenizer(make_task(TaskConfig(), 0).alphabet)


def hf_config(arch: str, vocab_size: int, layers: int = 2, experts: int = 4, top_k: int = 2):
    import transformers as tf

    common = dict(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    if arch == "llama":
        return tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
                              use_sliding_window=False, **common)
    if arch == "mistral":
        return tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                sliding_window=None, **common)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=128, **common)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                num_attention_heads=4, max_position_embeddings=128, **common)
    moe = dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, num_experts_per_tok=top_k, **common)
    if arch == "mixtral":  # Mixtral: every layer routed, gate weights renormalised
        return tf.MixtralConfig(intermediate_size=32, num_local_experts=experts, sliding_window=None, **moe)
    if arch == "qwen2_moe":  # Qwen2-MoE: routed experts plus a gated shared expert
        return tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                 num_experts=experts, norm_topk_prob=False, use_sliding_window=False, **moe)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=experts,
                                 norm_topk_prob=True, head_dim=8, **moe)
    raise ValueError(arch)


def save_tiny_model(arch: str, out: Path, seed: int = 0, layers: int = 2, **moe) -> Path:
    """config.json + model.safetensors + tokenizer files of a tiny ``arch`` model in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, tok.vocab_size, layers, **moe))
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def fake_hub_cache(cache: Path, repo_id: str, model_dir: Path, revision: str = "0" * 40) -> Path:
    """Lay ``model_dir``'s files out as the hub cache does (models--org--name/snapshots/<rev>/,
    refs/main); returns the snapshot directory."""
    import shutil

    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        shutil.copy2(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap
