"""The fast torch sampler (shared prefill, finished rows leave the batch, on-device sampling)
gives what the plain loop gives: the same greedy sequences, and log-probs equal to a
teacher-forced forward of the model on the sampled tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.algorithms.logprobs import token_log_probs
from engine.config.schema import ModelConfig, RolloutConfig
from engine.model.build import build_hf_model
from engine.rollout.torch_sampler import TorchSampler

PAD, EOS, VOCAB = 0, 1, 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    m = build_hf_model(cfg, "", VOCAB, seed=3, pad_token_id=PAD, eos_token_id=EOS).eval()
    with torch.no_grad():  # make EOS likely, so rows finish at different steps
        m.lm_head.weight[EOS] += 0.6 * m.lm_head.weight.std() * torch.randn(m.lm_head.weight.shape[1])
    return m


PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11, 3], [2]]


def _sampler(fast: bool, **kw) -> TorchSampler:
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=10, **kw)
    return TorchSampler(cfg, PAD, EOS, torch.device("cpu"), fast=fast)


def _teacher_forced(model, batch, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    lp, _ = token_log_probs(logits, batch.input_ids, temperature)
    return lp * batch.response_mask


def test_greedy_fast_equals_plain(model):
    fast = _sampler(True).generate(model, PROMPTS, 3, torch.Generator().manual_seed(0), greedy=True)
    plain = _sampler(False).generate(model, PROMPTS, 3, torch.Generator().manual_seed(0), greedy=True)
    assert torch.equal(fast.input_ids, plain.input_ids)
    assert torch.equal(fast.attention_mask, plain.attention_mask)
    assert torch.equal(fast.response_mask, plain.response_mask)
    assert torch.allclose(fast.rollout_log_probs, plain.rollout_log_probs, atol=1e-5)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_log_probs_match_teacher_forcing(model, temperature, top_p):
    s = _sampler(True, temperature=temperature, top_p=top_p)
    batch = s.generate(model, PROMPTS, 6, torch.Generator().manual_seed(1))
    lens = batch.response_lengths
    assert lens.min() < lens.max() == 10, "rows must finish at different steps to exercise row dropping"
    ref = _teacher_forced(model, batch, temperature)
    assert torch.allclose(batch.rollout_log_probs, ref, atol=1e-4), (batch.rollout_log_probs - ref).abs().max()
    # a response ends at its first EOS and nothing follows it
    for i in range(len(batch)):
        resp = batch.input_ids[i][batch.response_mask[i] > 0].tolist()
        assert EOS not in resp[:-1]
        assert resp[-1] == EOS or len(resp) == 10


def test_plain_sampled_log_probs_match_teacher_forcing(model):
    batch = _sampler(False).generate(model, PROMPTS, 4, torch.Generator().manual_seed(2))
    assert torch.allclose(batch.rollout_log_probs, _teacher_forced(model, batch, 1.0), atol=1e-4)


def test_same_seed_same_samples(model):
    a = _sampler(True).generate(model, PROMPTS, 4, torch.Generator().manual_seed(5))
    b = _sampler(True).generate(model, PROMPTS, 4, torch.Generator().manual_seed(5))
    assert torch.equal(a.input_ids, b.input_ids)


@pytest.mark.parametrize("fast", [True, False])
def test_ignore_eos_gives_fixed_length(model, fast):
    batch = _sampler(fast, ignore_eos=True).generate(model, PROMPTS, 4, torch.Generator().manual_seed(3))
    assert batch.response_lengths.tolist() == [10] * len(batch)
    assert not (batch.input_ids[batch.response_mask > 0] == EOS).any()
    # log-probs are the model's own (EOS is only forbidden when sampling)
    assert torch.allclose(batch.rollout_log_probs, _teacher_forced(model, batch, 1.0), atol=1e-4)


def test_micro_batches_keep_prompt_groups_and_order(model):
    whole = _sampler(True).generate(model, PROMPTS, 3, torch.Generator().manual_seed(0), greedy=True)
    chunked = _sampler(True, micro_batch_size=5).generate(model, PROMPTS, 3, torch.Generator().manual_seed(0),
                                                          greedy=True)
    assert torch.equal(whole.input_ids, chunked.input_ids)
    assert torch.equal(whole.prompt_lengths, torch.tensor([len(p) for p in PROMPTS for _ in range(3)]))


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_probabilities():
    """The fast sampler's token draw (engine.rollout.torch_sampler.sample_inverse_cdf) has the
    distribution of the probabilities it is given (unnormalised rows too), and never returns a
    token of probability 0: the first, the last and one in the middle are zero here."""
    from engine.rollout.torch_sampler import sample_inverse_cdf

    probs = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    rows = 20000
    draws = sample_inverse_cdf(probs.repeat(rows, 1) * 3.0, torch.rand(rows, generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(draws, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * rows
    nz = probs > 0
    chi2 = float((((counts - expected)[nz]) ** 2 / expected[nz]).sum())
    assert chi2 < 16.3, (counts, chi2)  # 3 degrees of freedom: p = 0.001
    edge = torch.tensor([[0.0, 1.0, 0.0]])  # all mass on one token, any draw
    assert all(int(sample_inverse_cdf(edge, torch.rand(1, generator=torch.Generator().manual_seed(s)))) == 1
               for s in range(50))
    assert int(sample_inverse_cdf(edge, torch.tensor([1.0 - 2 ** -24]))) == 1  # the largest uniform below 1
