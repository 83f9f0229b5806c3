"""A model's end tokens (engine/model/tokenizer.py, engine/rollout/base.py Sampler.set_ends): an
instruct model whose tokenizer names the document's end (<eos>) but whose turns end with another
token its generation config lists (Gemma's <end_of_turn>, Phi-3's <|end|>, the first Llama 3
Instruct's <|eot_id|>) must stop there, as transformers' generate and vLLM do; rl used to stop on
the tokenizer's eos alone, so such a model ran every response to rollout.max_new_tokens."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config.schema import ModelConfig, RolloutConfig
from engine.model.build import build_hf_model
from engine.model.tokenizer import CharTokenizer, HFTokenizer
from engine.rollout.torch_sampler import TorchSampler

ALPHABET = "abcdefghijklmnop"


def _model_dir(tmp_path, generation_eos=None, config_eos=None):
    tok = CharTokenizer(ALPHABET)
    tok.save_pretrained(tmp_path)
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    if config_eos is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": config_eos}))
    return tok, str(tmp_path)


def test_the_tokenizer_ends_on_every_end_token_the_model_names(tmp_path):
    tok, path = _model_dir(tmp_path / "gen", generation_eos=[1, tok_id("h"), 10_000])
    hf = HFTokenizer(path)
    assert hf.eos_token_id == 1 and hf.end_token_ids == (1, tok_id("h"))  # eos first; ids past the vocab dropped
    assert hf.decode(tok.encode("abchdef")) == "abc"  # a response's text ends at its first end token
    assert HFTokenizer(_model_dir(tmp_path / "plain")[1]).end_token_ids == (1,)
    assert HFTokenizer(_model_dir(tmp_path / "cfg", config_eos=tok_id("c"))[1]).end_token_ids == (1, tok_id("c"))


def tok_id(c: str) -> int:
    return CharTokenizer(ALPHABET).stoi[c]


@pytest.mark.parametrize("fast", [True, False], ids=["static_cache", "model_forward"])
def test_a_response_ends_at_the_first_of_the_models_end_tokens(fast):
    """Uniform next-token distribution over 19 tokens, 24 new tokens: with `h` among the model's end
    tokens, each response ends at its first `h` (kept, as EOS is) and the rest is padding; without,
    responses run past `h`; with rollout.ignore_eos, `h` is never sampled."""
    tok = CharTokenizer(ALPHABET)
    h = tok_id("h")
    model = build_hf_model(ModelConfig(), "", tok.vocab_size, 0, tok.pad_token_id, tok.eos_token_id).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: every token equally likely (eos too)
    prompts = [tok.encode("abc"), tok.encode("dd")]

    def sample(ends=(), ignore_eos=False):
        cfg = RolloutConfig(max_new_tokens=24, temperature=1.0, ignore_eos=ignore_eos)
        s = TorchSampler(cfg, tok.pad_token_id, tok.eos_token_id, torch.device("cpu"), fast=fast)
        s.set_ends({"eos": tok.eos_token_id, "ends": [tok.eos_token_id, *ends]})
        with torch.no_grad():
            b = s.generate(model, prompts, 8, torch.Generator().manual_seed(3))
        out = []
        for i in range(len(b)):
            p, n = int(b.prompt_lengths[i]), int(b.attention_mask[i].sum())
            out.append(b.input_ids[i, p:n].tolist())
        return out

    without = sample()
    assert any(h in r[:-1] for r in without), "no response ran past an `h`: the test would not see a change"
    with_h = sample(ends=(h,))
    assert all(r[-1] in (h, tok.eos_token_id) or len(r) == 24 for r in with_h), with_h
    assert all(h not in r[:-1] and tok.eos_token_id not in r[:-1] for r in with_h), with_h
    assert sum(r[-1] == h for r in with_h) >= 4
    forced = sample(ends=(h,), ignore_eos=True)
    assert all(len(r) == 24 and h not in r and tok.eos_token_id not in r for r in forced), forced
