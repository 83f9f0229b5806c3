"""The torch sampler's decode steps on a preallocated KV cache (engine/rollout/static_decode.py)
give what the model's own forward gives: the same sampled tokens (rows finishing at different
steps, so rows leave the cache) and the same log-probs, on each supported architecture; and
anything it does not support falls back to the model's own forward instead of decoding wrongly."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from engine.algorithms.logprobs import token_log_probs
from engine.config.schema import RolloutConfig
from engine.rollout.static_decode import StaticDecode
from engine.rollout.torch_sampler import TorchSampler

PAD, EOS, VOCAB = 0, 1, 40
PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], [2], [15, 16, 17]]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)


def _model(arch: str):
    import transformers as tf

    if arch == "llama":        # multi-head attention, untied head, llama3 rotary scaling
        cfg = tf.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":      # grouped-query attention, q/k/v biases, tied head
        cfg = tf.Qwen2Config(**COMMON, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":      # per-head q/k norms, explicit head_dim
        cfg = tf.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
        cls = tf.Qwen3ForCausalLM
    elif arch == "gpt2":       # not supported: the model's own forward decodes
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
        cls = tf.GPT2LMHeadModel
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = cls(cfg).eval()
    head = m.get_output_embeddings().weight
    with torch.no_grad():  # make EOS likely, so rows finish at different steps
        head[EOS] += 0.8 * head.std() * torch.randn(head.shape[1])
    return m


def _generate(model, static: bool, seed: int = 1, **kw):
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=12, **kw)
    return TorchSampler(cfg, PAD, EOS, torch.device("cpu"), static_cache=static).generate(
        model, PROMPTS, 4, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_decode_samples_what_the_model_forward_samples(arch):
    model = _model(arch)
    assert StaticDecode.start(model, *_prefill_cache(model), 4) is not None  # the path under test runs
    dynamic, static = _generate(model, False), _generate(model, True)
    lens = static.response_lengths
    assert lens.min() < lens.max(), "rows must finish at different steps to exercise rows leaving the cache"
    assert torch.equal(static.input_ids, dynamic.input_ids)
    assert torch.equal(static.response_mask, dynamic.response_mask)
    assert torch.allclose(static.rollout_log_probs, dynamic.rollout_log_probs, atol=1e-5)
    with torch.no_grad():  # and both are the model's own log-probs of the sampled tokens
        logits = model(input_ids=static.input_ids, attention_mask=static.attention_mask, use_cache=False).logits
    ref, _ = token_log_probs(logits, static.input_ids, 1.0)
    assert torch.allclose(static.rollout_log_probs, ref * static.response_mask, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_decode_greedy_fixed_length_matches(arch):
    model = _model(arch)
    kw = dict(ignore_eos=True, temperature=0.7, top_p=0.9)
    assert torch.equal(_generate(model, True, **kw).input_ids, _generate(model, False, **kw).input_ids)
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=12)
    greedy = [TorchSampler(cfg, PAD, EOS, torch.device("cpu"), static_cache=s).generate(
        model, PROMPTS, 1, torch.Generator().manual_seed(0), greedy=True) for s in (True, False)]
    assert torch.equal(greedy[0].input_ids, greedy[1].input_ids)


def _prefill_cache(model):
    ids = torch.tensor([[5, 6, 7]])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return cache, attn


def test_unsupported_models_fall_back_to_their_own_forward():
    """GPT-2 (another layout), a sliding-window Mistral and a LoRA-wrapped model: StaticDecode
    declines, and the sampler still generates (through the model's forward)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    gpt2 = _model("gpt2")
    assert StaticDecode.start(gpt2, *_prefill_cache(gpt2), 4) is None
    assert _generate(gpt2, True).input_ids.shape[0] == 4 * len(PROMPTS)

    cfg = tf.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    cfg._attn_implementation = "sdpa"
    mistral = tf.MistralForCausalLM(cfg).eval()
    assert StaticDecode.start(mistral, *_prefill_cache(mistral), 4) is None

    lora = get_peft_model(_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    with torch.no_grad():  # non-zero adapters, so a path that skipped them would sample differently
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    lora.eval()
    with warnings.catch_warnings():  # the cache goes by the name the model underneath takes (engine/model/hf_cache.py):
        warnings.simplefilter("error", FutureWarning)  # past_key_values warns in transformers 5.2x and goes in 5.40
        assert torch.equal(_generate(lora, True).input_ids, _generate(lora, False).input_ids)


def test_cache_is_sized_once_and_rows_leave_it():
    model = _model("llama")
    cache, attn = _prefill_cache(model)
    dec = StaticDecode.start(model, cache, attn, 5)
    assert dec is not None and dec.keys[0].shape[2] == 3 + 5
    before = dec.cache_bytes()
    dec.step(torch.tensor([4]), torch.tensor([[3]]))
    assert dec.cache_bytes() == before  # written in place, never grown
    dec.select(torch.tensor([], dtype=torch.long))
    assert dec.cache_bytes() == 0


def _lanes_generate(model, lanes: int, **kw):
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=12, decode_lanes=lanes, **kw)
    s = TorchSampler(cfg, PAD, EOS, torch.device("cpu"))
    return s, s.generate(model, PROMPTS, 4, torch.Generator().manual_seed(7))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_lanes_sample_what_one_lane_samples(arch):
    """Decode lanes (rows split into whole prompt groups, each lane on its own thread) change
    nothing but the speed: the same tokens, lengths and log-probs as one lane, with rows
    finishing at different steps in every lane."""
    model = _model(arch)
    _, one = _lanes_generate(model, 1)
    lens = one.response_lengths
    assert lens.min() < lens.max(), "rows must finish at different steps"
    for lanes in (2, 3, 9):  # 9 > 5 prompt groups: at most one lane a group
        s, many = _lanes_generate(model, lanes)
        assert s.last_lanes == min(lanes, len(PROMPTS))
        assert torch.equal(many.input_ids, one.input_ids)
        assert torch.equal(many.response_mask, one.response_mask)
        assert torch.allclose(many.rollout_log_probs, one.rollout_log_probs, atol=1e-5)


def test_decode_lanes_restore_the_thread_count_and_take_whole_prompt_groups():
    model = _model("llama")
    before = torch.get_num_threads()
    s, _ = _lanes_generate(model, 2)
    assert torch.get_num_threads() == before
    owner = [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]
    for want in (1, 2, 3, 4, 6):
        s.cfg = dataclasses.replace(s.cfg, decode_lanes=want)
        lanes = [x.tolist() for x in s._lanes(owner)]
        assert len(lanes) == min(want, 4)
        assert sum(lanes, []) == list(range(len(owner)))          # every row once, in order
        for lane in lanes:                                         # never a prompt group split
            assert lane[0] == 0 or owner[lane[0] - 1] != owner[lane[0]]
            assert lane[-1] == len(owner) - 1 or owner[lane[-1]] != owner[lane[-1] + 1]
    s.cfg = dataclasses.replace(s.cfg, decode_lanes=2)
    assert [len(x) for x in s._lanes(owner)] == [4, 6]                  # as even as whole groups allow
    assert [len(x) for x in s._lanes([i // 8 for i in range(64)])] == [32, 32]


def test_sampled_tokens_do_not_depend_on_rollout_chunks():
    """The sampling noise is drawn per row and step up front, so generating the rows in chunks
    (rollout.micro_batch_size) samples what generating them at once does."""
    model = _model("llama")
    whole = _lanes_generate(model, 1)[1]
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=12, micro_batch_size=8)
    chunked = TorchSampler(cfg, PAD, EOS, torch.device("cpu")).generate(model, PROMPTS, 4,
                                                                        torch.Generator().manual_seed(7))
    assert torch.equal(whole.input_ids, chunked.input_ids)
    assert torch.allclose(whole.rollout_log_probs, chunked.rollout_log_probs, atol=1e-5)


def test_a_lane_thread_runs_on_the_rollouts_cuda_device(monkeypatch):
    """Each decode lane is a thread of its own, and a thread starts on CUDA device 0: on a rank's
    ``cuda:N`` (every GPU visible) a lane sets N as its current device for its life, so streams and
    index-less tensors go where the rollout's do. On CPU: every lane enters the device's context,
    and the context for cuda:3 names device 3."""
    import contextlib

    import engine.rollout.torch_sampler as ts

    entered = []

    def recording(device):
        entered.append(str(device))
        return contextlib.nullcontext()

    monkeypatch.setattr(ts, "on_device", recording)
    s, _ = _lanes_generate(_model("llama"), 3)
    assert s.last_lanes == 3 and entered == ["cpu"] * 3
    monkeypatch.undo()
    ctx = ts.on_device(ts.lane_device(torch.device("cuda", 3)))
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 3
    assert not isinstance(ts.on_device("cpu"), torch.cuda.device)
