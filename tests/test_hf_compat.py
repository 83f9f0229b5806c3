"""transformers renames (engine/model/hf_cache.py, engine/model/grad_checkpointing.py): rl passes a
model the KV cache under the name its forward takes and enables checkpointing by the current name,
whatever wraps the model, so no deprecated name is used (past_key_values goes in transformers 5.40,
gradient_checkpointing_enable in v6)."""

from __future__ import annotations

import warnings

import pytest
import torch

from engine.model.grad_checkpointing import enable_checkpointing
from engine.model.hf_cache import cache_kwarg, returned_cache, underlying


def _llama():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    return tf.LlamaForCausalLM(cfg).eval()


class OldForward(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True):
        return input_ids


def test_the_cache_keyword_is_read_from_the_model_under_its_wrappers():
    from peft import LoraConfig, get_peft_model

    llama = _llama()
    takes_cache = "cache" in __import__("inspect").signature(llama.forward).parameters
    expected = "cache" if takes_cache else "past_key_values"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft itself reads a renamed property
        lora = get_peft_model(_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    compiled = torch.compile(llama)  # (lazy: nothing compiles until it is called)
    assert underlying(lora) is lora.get_base_model() and underlying(compiled) is llama
    assert [cache_kwarg(m) for m in (llama, lora, compiled, torch.compile(lora))] == [expected] * 4
    assert cache_kwarg(OldForward()) == "past_key_values"

    ids = torch.tensor([[3, 4, 5]])
    with warnings.catch_warnings():  # the name chosen is the one the model takes without a deprecation
        warnings.simplefilter("error", FutureWarning)
        out = lora(input_ids=ids, use_cache=True)
        cache = returned_cache(out)
        nxt = lora(input_ids=torch.tensor([[6]]), use_cache=True, **{cache_kwarg(lora): cache})
        full = lora(input_ids=torch.tensor([[3, 4, 5, 6]])).logits[:, -1]  # the cache was used, and right
    assert torch.allclose(nxt.logits[:, -1], full, atol=1e-5)


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_checkpointing_is_enabled_by_the_current_name_in_the_mode_asked(reentrant):
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_checkpointing(model, reentrant)
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing
    # transformers' default is non-reentrant (the mode activation offload cannot hook, engine/memory)
    assert layer._gradient_checkpointing_func.keywords.get("use_reentrant") is (reentrant or False)
