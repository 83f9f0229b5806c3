"""CUDA-graph decoding (engine/rollout/graphed_decode.py, rollout.cuda_graphs): the static-shape
decode step -- device-side step index, attention over the whole cache under the mask, no host sync
per step, rows compacted into batch-size buckets -- samples what the sampler's dynamic path samples,
token for token, with the same log-probs and lengths, on every supported architecture. On a CPU the
steps run eagerly (what is tested here); a GPU captures and replays them (not yet run on one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config.schema import RolloutConfig
from engine.rollout.graphed_decode import buckets, compaction, decode_graphed
from engine.rollout.static_decode import StaticDecode
from engine.rollout.torch_sampler import TorchSampler
from tests.test_static_decode import EOS, PAD, PROMPTS, _model


def _generate(model, static_shapes: bool, n=4, greedy=False, **kw):
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=kw.pop("max_new_tokens", 20), decode_lanes=1, **kw)
    s = TorchSampler(cfg, PAD, EOS, torch.device("cpu"))
    s.static_shapes = static_shapes
    return s.generate(model, PROMPTS, n, torch.Generator().manual_seed(3), greedy=greedy)


def _same(a, b):
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.allclose(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_shape_steps_sample_what_the_dynamic_path_samples(arch):
    model = _model(arch)
    dynamic, static = _generate(model, False), _generate(model, True)
    lens = static.response_lengths
    assert lens.min() < 6 and lens.max() == 20, "rows must end at different steps (compactions) and some run out"
    _same(static, dynamic)


@pytest.mark.parametrize("kw", [dict(greedy=True, n=1), dict(ignore_eos=True, temperature=0.7, top_p=0.9),
                                dict(top_p=0.8, max_new_tokens=9)], ids=["greedy", "ignore_eos_top_p", "top_p"])
def test_static_shape_steps_follow_every_sampling_rule(kw):
    model = _model("llama")
    _same(_generate(model, True, **dict(kw)), _generate(model, False, **dict(kw)))


def test_rows_are_compacted_into_smaller_buckets_as_they_end():
    """decode_graphed directly, looking every 2 steps: the batch shrinks through the buckets while
    the result stays the dynamic path's."""
    model = _model("qwen2")
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=20, decode_lanes=1)
    sampler = TorchSampler(cfg, PAD, EOS, torch.device("cpu"))
    ids, attn, pos = sampler._left_padded(PROMPTS)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    logits = out.logits[:, -1, :].float()
    noise = torch.rand((len(PROMPTS), 20), generator=torch.Generator().manual_seed(0))
    eos = torch.tensor([EOS])
    results = []
    for static in (False, True):
        d = StaticDecode.start(model, cache, attn, 20, positions=pos[:, -1:] + 1, rows=torch.arange(len(PROMPTS)))
        sizes = []
        select = d.select
        d.select = lambda rows, select=select, sizes=sizes: (sizes.append(len(rows)), select(rows))
        with torch.no_grad():
            if static:
                assert d.make_static()
                r = decode_graphed(d, lambda lg, u: sampler._sample(lg, u, eos), logits, noise, 20,
                                   sampler._stops("cpu"), PAD, False, capture=False, check_every=2)
            else:
                r = sampler._decode(d, logits, noise)
        results.append((r, sizes))
    (dyn, _), (stat, sizes) = results
    assert torch.equal(stat[0], dyn[0]) and torch.equal(stat[2], dyn[2]) and stat[3] == dyn[3]
    assert torch.allclose(stat[1], dyn[1], atol=1e-5)
    assert sizes and all(s in buckets(len(PROMPTS)) for s in sizes) and sizes == sorted(sizes, reverse=True)


def test_buckets_and_compaction():
    assert buckets(20) == [20, 16, 8, 4, 2, 1] and buckets(16) == [16, 8, 4, 2, 1] and buckets(1) == [1]
    live = torch.tensor([False, True, False, True, True, False])
    assert compaction(live, 4).tolist() == [1, 3, 4, 0]  # live rows first, in order, then filler


def test_cuda_graphs_on_a_cpu_run_is_refused():
    from engine.config.load import load_run_config
    from engine.device import check_device_config
    from engine.errors import ConfigError

    cfg = load_run_config(["rollout.cuda_graphs=true", "trainer.device=cpu"]).config
    with pytest.raises(ConfigError, match="rollout.cuda_graphs=false"):
        check_device_config(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_graphs_sample_what_the_dynamic_path_samples_on_cuda(arch):
    """On a GPU the steps are captured and replayed (a new graph per bucket): same tokens and lengths
    as the dynamic path from the same noise, log-probs within fp32 reordering."""
    model = _model(arch).cuda()
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=20, decode_lanes=1)
    out = []
    for static in (False, True):
        s = TorchSampler(cfg, PAD, EOS, torch.device("cuda"))
        s.static_shapes = static
        out.append(s.generate(model, PROMPTS, 4, torch.Generator().manual_seed(3)))
    assert out[1].response_lengths.min() < out[1].response_lengths.max()
    assert torch.equal(out[0].input_ids, out[1].input_ids)
    assert torch.allclose(out[0].rollout_log_probs, out[1].rollout_log_probs, atol=1e-4)
