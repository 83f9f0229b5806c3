"""Length-bucket padding (issue 6): alignment, bucket policies, micro-batching, config checks.

The padding-invariance tests run a real (tiny) transformers LlamaForCausalLM in float64 and check
that bucket padding changes nothing that reaches training: per-token log-probs, entropy, the
masked token-mean loss and every parameter gradient equal those of each sequence run alone,
without any padding.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random

import pytest
import torch

from engine.batch import SequenceBatch
from engine.batching.buckets import (LearnedPolicy, fit_new_boundaries, make_bucket_policy,
                                     required_alignment, round_up, smoothed_histogram)
from engine.batching.microbatch import pad_stats, scatter_back, split_micro_batches
from engine.batching.validate import validate_padding_config, validate_run_padding
from engine.config.schema import FSDPEngineConfig, MegatronEngineConfig, RunConfig
from engine.errors import ConfigError

PAD = 0


def make_batch(lengths, vocab=50, seed=0) -> SequenceBatch:
    """Right-padded rows of the given lengths: 2-4 prompt tokens, the rest response."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.full((b, t), PAD, dtype=torch.long)
    am = torch.zeros(b, t, dtype=torch.long)
    rm = torch.zeros(b, t)
    pl = torch.zeros(b, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        am[i, :n] = 1
        p = min(n - 1, 2 + i % 3)
        pl[i] = p
        rm[i, p:n] = 1.0
    adv = torch.randn(b, t, generator=g) * am
    return SequenceBatch(ids, am, rm, pl, advantages=adv)


def long_tailed(rng: random.Random, n: int, median: float, cap: int) -> list[int]:
    return [min(cap, max(1, int(rng.lognormvariate(math.log(median), 0.8)))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# alignment
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, expected", [
    (dict(pad_to_length=False), 1),
    (dict(pad_to_length=True, pad_to_length_bucket=16), 16),
    (dict(pad_to_length=True, pad_to_length_bucket=10, tensor_model_parallel_size=4,
          sequence_parallel=True), 20),                                   # lcm(10, tp=4)
    (dict(pad_to_length=True, pad_to_length_bucket=10, tensor_model_parallel_size=4,
          sequence_parallel=False), 10),                                  # TP without SP: no constraint
    (dict(pad_to_length=False, tensor_model_parallel_size=4, sequence_parallel=True), 4),
    (dict(pad_to_length=False, context_parallel_size=3), 6),              # 2*cp chunks
    (dict(pad_to_length=False, context_parallel_size=2, tensor_model_parallel_size=4,
          sequence_parallel=True), 8),                                    # cp * lcm(tp, 2)
    (dict(pad_to_length=True, pad_to_length_bucket=12, context_parallel_size=2,
          tensor_model_parallel_size=4, sequence_parallel=True), 24),     # lcm(12, 8)
    (dict(pad_to_length=False, fp8=True), 16),
    (dict(pad_to_length=True, pad_to_length_bucket=24, fp8=True, context_parallel_size=2), 96),
    # FP8 + SP: TE checks each rank's pre-all-gather slice, (T / tp) * rows % 8 == 0, for any rows
    (dict(pad_to_length=False, fp8=True, tensor_model_parallel_size=2, sequence_parallel=True), 16),
    (dict(pad_to_length=False, fp8=True, tensor_model_parallel_size=4, sequence_parallel=True), 32),
    (dict(pad_to_length=False, fp8=True, tensor_model_parallel_size=8, sequence_parallel=True), 64),
    (dict(pad_to_length=False, fp8=True, tensor_model_parallel_size=8, sequence_parallel=False), 16),
])
def test_required_alignment_is_the_lcm_of_every_constraint(kwargs, expected):
    """One function computes the alignment: bucket, SP-sharded TP, load-balanced CP, FP8."""
    assert required_alignment(MegatronEngineConfig(**kwargs)) == expected


def test_alignment_satisfies_megatron_sequence_splits():
    """T divides into 2*cp chunks, and each CP rank's slice (T/cp) divides over TP (SP) and by 16 (FP8)."""
    for tp, cp, fp8, bucket in itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4], [False, True], [1, 16, 24]):
        cfg = MegatronEngineConfig(pad_to_length=True, pad_to_length_bucket=bucket, fp8=fp8,
                                   tensor_model_parallel_size=tp, context_parallel_size=cp,
                                   sequence_parallel=tp > 1)
        a = required_alignment(cfg)
        assert a % bucket == 0
        if cp > 1:
            assert a % (2 * cp) == 0
        local = a // cp
        assert local % tp == 0 and (not fp8 or local % 16 == 0)
        # Transformer-Engine's FP8 linears assert math.prod(inp.shape[:-1]) % 8 == 0 on the input
        # *before* a sequence-parallel all-gather ([L / tp, rows, h]; transformer_engine/pytorch/
        # utils.py assert_dim_for_fp8_exec, called by layernorm_linear.py / linear.py, v2.x)
        if fp8:
            for rows in (1, 3):
                assert ((local // tp if tp > 1 else local) * rows) % 8 == 0


@pytest.mark.parametrize("policy", ["multiple", "geometric", "learned", "none"])
def test_every_policy_returns_aligned_boundaries_that_cover_the_length(policy):
    """bucket_length(n) >= n, is a multiple of required_alignment and is one of boundaries()."""
    cfg = MegatronEngineConfig(pad_to_length=policy != "none", pad_to_length_bucket=10,
                               pad_to_length_policy=policy if policy != "none" else "multiple",
                               tensor_model_parallel_size=4, sequence_parallel=True,
                               max_tokens_per_micro_batch=1000)
    p = make_bucket_policy(cfg)
    a = required_alignment(cfg)
    if policy == "learned":
        p.observe(long_tailed(random.Random(1), 300, 150, 900))
        p.maybe_refresh(100)
    bounds = set(p.boundaries())
    assert p.max_length <= 1000 and p.max_length % a == 0
    for n in range(1, p.max_length + 1):
        b = p.bucket_length(n)
        assert b >= n and b % a == 0 and b in bounds
    assert p.overflows == 0


# ---------------------------------------------------------------------------------------------
# learned policy
# ---------------------------------------------------------------------------------------------

def test_learned_fit_is_optimal_against_brute_force():
    """fit_new_boundaries finds the least-padding set of new boundaries (checked exhaustively)."""
    rng = random.Random(0)
    for _ in range(150):
        a, top = 4, 64
        hist = {}
        for _ in range(rng.randint(1, 12)):
            n = rng.randint(1, top)
            w = rng.randint(1, 5)
            cell = hist.setdefault(round_up(n, a), [0.0, 0.0])
            cell[0] += w
            cell[1] += w * n
        existing = sorted({top} | set(rng.sample(range(a, top, a), rng.randint(0, 2))))
        max_new = rng.randint(1, 3)
        got = fit_new_boundaries(hist, existing, max_new)

        def cost(bs):
            bs = sorted(bs)
            return sum(bs[bisect.bisect_left(bs, k)] * w - s for k, (w, s) in hist.items())

        cands = sorted(set(hist) - set(existing))
        best = min(cost(existing + list(c)) for r in range(max_new + 1)
                   for c in itertools.combinations(cands, min(r, len(cands))))
        assert len(got) <= max_new and not set(got) & set(existing)
        assert cost(existing + got) == pytest.approx(best)


def test_smoothing_preserves_mass_spreads_isolated_lengths_and_keeps_repeated_ones():
    """The learned fit's smoothed distribution keeps the total weight, spreads a length seen
    once over its nearest-neighbour cell, and keeps most of a repeated length put."""
    hist = {}
    for n, w in [(100, 1.0), (900, 2.0), (1500, 1.0)] + [(2040, 1.0)] * 10:
        cell = hist.setdefault(round_up(n, 16), [0.0, 0.0, 0.0])
        cell[0] += w
        cell[1] += w * n
        cell[2] += 1
    sm = smoothed_histogram(hist, 16, 2048, extra_points=[1000])
    assert sum(w for w, _ in sm.values()) == pytest.approx(sum(c[0] for c in hist.values()))
    assert all(k % 16 == 0 or k == 1000 for k in sm)
    between = sum(w for k, (w, _) in sm.items() if 500 < k <= 1200)   # 900's cell: (500, 1200]
    assert between == pytest.approx(2.0, abs=0.02)
    assert len([k for k in sm if 500 < k <= 1200]) > 10
    assert sm[2048][0] >= 8.0                                       # 10 repeats: 8 stay put


@pytest.mark.parametrize("k", [2, 4, 8])
def test_learned_never_exceeds_k_and_never_removes_a_boundary(k):
    """Over many refreshes on drifting long-tailed data: <= K boundaries, each one kept forever,
    all aligned, the top always present; a copy restored from the JSON state at step 150 makes
    exactly the same decisions afterwards."""
    rng = random.Random(k)
    p = LearnedPolicy(alignment=16, max_length=4096, max_shapes=k, refresh_steps=2)
    twin = None
    seen: set[int] = set()
    for step in range(1, 301):
        median = 60 * (1.01 ** step)                      # responses lengthen as training goes
        lengths = long_tailed(rng, 32, median, 4096)
        weights = [rng.randint(1, 8) for _ in range(32)]
        for policy in (p, twin) if twin else (p,):
            policy.observe(lengths, weights)
            policy.maybe_refresh(step)
        bounds = p.boundaries()
        assert len(bounds) <= k
        assert seen <= set(bounds), "a boundary was removed"
        assert bounds == sorted(bounds) and bounds[-1] == 4096
        assert all(b % 16 == 0 for b in bounds)
        seen = set(bounds)
        if twin is not None:
            assert twin.boundaries() == bounds
        if step == 150:
            twin = LearnedPolicy(alignment=16, max_length=4096, max_shapes=k, refresh_steps=2)
            twin.load_state_dict(json.loads(json.dumps(p.state_dict())))
            assert twin.boundaries() == bounds
    assert len(seen) == k, "all K slots end up used on a drifting distribution"


def test_learned_pads_little_with_few_shapes():
    """On a stationary long-tailed packed stream, learned (K=8) pads under 5% of tokens with at
    most 8 shapes: less than half a fixed budget's padding, fewer shapes than multiple-of-16."""
    cfg = FSDPEngineConfig(pad_to_length=True, pad_to_length_policy="learned", pad_to_length_bucket=16,
                           pad_to_length_max_shapes=8, pad_to_length_refresh_steps=2,
                           max_tokens_per_micro_batch=2048)
    policies = {
        "learned": make_bucket_policy(cfg),
        "multiple16": make_bucket_policy(FSDPEngineConfig(**{**cfg.__dict__, "pad_to_length_policy": "multiple"})),
        "fixed": make_bucket_policy(FSDPEngineConfig(**{**cfg.__dict__, "pad_to_length_policy": "multiple",
                                                        "pad_to_length_bucket": 2048})),
    }
    rng = random.Random(3)
    batches = [make_batch([n + 40 for n in long_tailed(rng, 48, 200, 1000)], seed=s) for s in range(16)]
    stats = {}
    for name, policy in policies.items():
        mbs = []
        for step, batch in enumerate(batches, start=1):
            out = split_micro_batches(batch, cfg, policy, PAD, layout="packed")
            if step > 8:                                   # after the learned policy has fitted
                mbs += out
            policy.maybe_refresh(step)
        stats[name] = pad_stats(mbs)
    assert stats["learned"]["distinct_shapes"] <= 8
    assert stats["learned"]["pad_fraction"] < 0.05
    assert stats["learned"]["distinct_shapes"] < stats["multiple16"]["distinct_shapes"]
    assert stats["learned"]["pad_fraction"] < stats["fixed"]["pad_fraction"] / 2


# ---------------------------------------------------------------------------------------------
# micro-batching
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("mbs", [0, 3])
def test_split_keeps_every_row_once_pads_only_a_masked_suffix_and_respects_the_budget(layout, mbs):
    """Every original row lands in exactly one micro-batch, unchanged; padding is a suffix with
    attention and response masks 0; padded tokens stay within the budget; the split is
    deterministic; shapes are bucket lengths."""
    rng = random.Random(5)
    lengths = [rng.randint(3, 60) for _ in range(23)]
    batch = make_batch(lengths)
    cfg = FSDPEngineConfig(pad_to_length=True, pad_to_length_bucket=16, micro_batch_size=mbs,
                           max_tokens_per_micro_batch=128)
    policy = make_bucket_policy(cfg, max_length=64 if layout == "padded" else None)
    mbs_out = split_micro_batches(batch, cfg, policy, PAD, layout=layout)
    again = split_micro_batches(batch, cfg, policy, PAD, layout=layout)
    assert [m.indices.tolist() for m in mbs_out] == [m.indices.tolist() for m in again]
    assert sorted(torch.cat([m.indices for m in mbs_out]).tolist()) == list(range(len(lengths)))
    for m in mbs_out:
        assert m.padded_tokens == math.prod(m.shape)
        assert m.real_tokens == sum(lengths[i] for i in m.indices.tolist())
        assert m.shape[-1] % 16 == 0
        if mbs == 0:
            assert m.padded_tokens <= 128
        else:
            assert m.num_rows <= mbs
        if layout == "padded":
            b = m.batch
            for r, orig in enumerate(m.indices.tolist()):
                n = lengths[orig]
                assert torch.equal(b.input_ids[r, :n], batch.input_ids[orig, :n])
                assert torch.equal(b.advantages[r, :n], batch.advantages[orig, :n])
                assert b.attention_mask[r, n:].sum() == 0 and b.response_mask[r, n:].sum() == 0
                assert (b.input_ids[r, n:] == PAD).all()
        else:
            p = m.packed
            assert p.input_ids.shape == m.shape == p.position_ids.shape
            assert int(p.cu_seqlens[-1]) == m.shape[1]
            back = p.unpack(p.input_ids)
            for r, orig in enumerate(m.indices.tolist()):
                n = lengths[orig]
                assert torch.equal(back[r, :n], batch.input_ids[orig, :n])
                assert torch.equal(m.batch.input_ids[r, :n], batch.input_ids[orig, :n])
            pad_pos = p.position_ids[0, m.real_tokens:]
            assert torch.equal(pad_pos, torch.arange(p.num_pad))


def test_padded_layout_with_pad_rows_has_one_shape_per_bucket():
    """pad_rows fills the last micro-batch with empty rows, so each shape is (budget // T, T)."""
    rng = random.Random(9)
    cfg = FSDPEngineConfig(pad_to_length=True, pad_to_length_policy="multiple", pad_to_length_bucket=32,
                           max_tokens_per_micro_batch=256)
    policy = make_bucket_policy(cfg)
    shapes = set()
    for seed in range(6):
        batch = make_batch([rng.randint(3, 120) for _ in range(rng.randint(5, 30))], seed=seed)
        for m in split_micro_batches(batch, cfg, policy, PAD, pad_rows=True):
            t = m.shape[1]
            assert m.shape[0] == 256 // t
            extra = m.batch.attention_mask[m.num_rows:]
            assert extra.sum() == 0 and m.batch.response_mask[m.num_rows:].sum() == 0
            shapes.add(m.shape)
    assert {t for _, t in shapes} <= set(policy.boundaries())
    assert len(shapes) == len({t for _, t in shapes})


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_min_micro_batches_is_honoured(layout):
    """Ranks that must agree on the number of passes get at least min_micro_batches."""
    batch = make_batch([5, 9, 12, 3, 7, 8])
    cfg = FSDPEngineConfig(max_tokens_per_micro_batch=4096)
    assert len(split_micro_batches(batch, cfg, None, PAD, layout=layout)) == 1
    out = split_micro_batches(batch, cfg, None, PAD, layout=layout, min_micro_batches=4)
    assert len(out) == 4
    assert sorted(torch.cat([m.indices for m in out]).tolist()) == list(range(6))
    with pytest.raises(ValueError):
        split_micro_batches(batch, cfg, None, PAD, layout=layout, min_micro_batches=7)


def test_pad_stats_counts_bucket_and_ragged_padding():
    """pad_fraction counts all padding; bucket_pad_fraction only what the bucket added."""
    batch = make_batch([10, 6])
    cfg = FSDPEngineConfig(pad_to_length=True, pad_to_length_bucket=16, micro_batch_size=2)
    s = pad_stats(split_micro_batches(batch, cfg, None, PAD))
    assert s["real_tokens"] == 16 and s["natural_tokens"] == 20 and s["padded_tokens"] == 32
    assert s["pad_fraction"] == pytest.approx(0.5) and s["bucket_pad_fraction"] == pytest.approx(12 / 32)
    assert s["distinct_shapes"] == 1 and s["shapes"] == [(2, 16)]


# ---------------------------------------------------------------------------------------------
# padding invariance with a real model
# ---------------------------------------------------------------------------------------------

def tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).double()


def shifted_log_probs(logits, ids):
    """log p(ids[:, t] | <t) at position t (0 at t = 0), and per-position entropy."""
    logp = torch.log_softmax(logits, -1)
    lp = torch.zeros(ids.shape, dtype=logits.dtype)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def reference(model, batch, n_tokens):
    """Each row alone, no padding at all: log-probs, entropy, loss, grads."""
    model.zero_grad()
    b, t = batch.input_ids.shape
    lp_all = torch.zeros(b, t, dtype=torch.float64)
    ent_all = torch.zeros(b, t, dtype=torch.float64)
    loss_total = 0.0
    for r in range(b):
        n = int(batch.attention_mask[r].sum())
        ids = batch.input_ids[r:r + 1, :n]
        lp, ent = shifted_log_probs(model(input_ids=ids, use_cache=False).logits, ids)
        loss = -(lp * batch.advantages[r:r + 1, :n] * batch.response_mask[r:r + 1, :n]).sum() / n_tokens
        loss.backward()
        loss_total += loss.item()
        lp_all[r, :n] = lp[0].detach()
        ent_all[r, :n] = ent[0].detach()
    return lp_all, ent_all, loss_total, {k: p.grad.clone() for k, p in model.named_parameters()}


def bucketed(model, batch, n_tokens, layout, pad_rows=False):
    """Micro-batched with bucket padding, outputs scattered back by indices."""
    model.zero_grad()
    cfg = FSDPEngineConfig(pad_to_length=True, pad_to_length_bucket=16, max_tokens_per_micro_batch=96)
    b, t = batch.input_ids.shape
    lps, ents = [], []
    loss_total, padded = 0.0, 0
    mbs = split_micro_batches(batch, cfg, make_bucket_policy(cfg, max_length=96), PAD,
                              layout=layout, pad_rows=pad_rows)
    for m in mbs:
        mb = m.batch
        if layout == "padded":
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            lp, ent = shifted_log_probs(logits, mb.input_ids)
            lp, ent = lp * mb.attention_mask, ent * mb.attention_mask
        else:
            p = m.packed
            logits = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False).logits
            lp_flat, ent_flat = shifted_log_probs(logits, p.input_ids)
            lp, ent = p.unpack(lp_flat), p.unpack(ent_flat)
            lp = torch.cat([torch.zeros_like(lp[:, :1]), lp[:, 1:]], 1)  # t = 0 predicts nothing
        assert torch.isfinite(logits).all()
        loss = -(lp * mb.advantages * mb.response_mask).sum() / n_tokens
        loss.backward()
        loss_total += loss.item()
        lps.append(lp.detach())
        ents.append(ent.detach())
        padded += m.padded_tokens - m.natural_tokens
    assert padded > 0, "the test must actually pad"
    lp_all, ent_all = scatter_back(mbs, lps, b, t), scatter_back(mbs, ents, b, t)
    return lp_all, ent_all, loss_total, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layout, pad_rows", [("padded", False), ("padded", True), ("packed", False)])
def test_bucket_padding_leaves_log_probs_entropy_loss_and_grads_unchanged(attn, layout, pad_rows):
    """Log-probs, entropy, masked token-mean loss and every gradient with bucket padding equal
    those of each sequence run alone. float64 model; sdpa agrees to 1e-10. Eager attention
    computes its softmax in float32 (transformers upcasts it), whose reduction order depends on
    the row width, so it agrees to float32 rounding (1e-6)."""
    model = tiny_llama(attn)
    batch = make_batch([7, 19, 3, 12, 30, 22, 5, 14, 9], seed=1)
    n_tokens = batch.response_mask.sum()
    ref_lp, ref_ent, ref_loss, ref_grads = reference(model, batch, n_tokens)
    lp, ent, loss, grads = bucketed(model, batch, n_tokens, layout, pad_rows)
    mask = batch.attention_mask.bool()
    tol = 1e-10 if attn == "sdpa" else 1e-6
    torch.testing.assert_close(lp[mask], ref_lp[mask], atol=tol, rtol=0)
    torch.testing.assert_close(ent[mask], ref_ent[mask], atol=tol, rtol=0)
    assert loss == pytest.approx(ref_loss, abs=tol)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=tol, rtol=tol * 100, msg=name)


# ---------------------------------------------------------------------------------------------
# config-time refusals
# ---------------------------------------------------------------------------------------------

def test_policy_without_pad_to_length_is_refused():
    """A learned/geometric policy with pad_to_length off would silently do nothing: refused."""
    with pytest.raises(ConfigError, match="pad_to_length=true"):
        validate_padding_config(FSDPEngineConfig(pad_to_length=False, pad_to_length_policy="learned"))


def test_budget_smaller_than_one_bucket_is_refused():
    """A token budget below the alignment cannot hold a single bucket."""
    cfg = MegatronEngineConfig(pad_to_length=True, pad_to_length_bucket=64, tensor_model_parallel_size=3,
                               sequence_parallel=True, max_tokens_per_micro_batch=100)
    with pytest.raises(ConfigError, match="at least 192"):
        validate_padding_config(cfg)
    cfg.micro_batch_size = 4                              # budget unused in row-count mode
    validate_padding_config(cfg)


def test_longest_sequence_that_cannot_fit_the_budget_is_refused():
    """prompt + response that pads past the token budget is refused before the run."""
    run = RunConfig()
    run.engine = FSDPEngineConfig(pad_to_length=True, pad_to_length_bucket=128, max_tokens_per_micro_batch=256)
    run.data.max_prompt_length, run.rollout.max_new_tokens = 100, 160   # 260 -> 384 > 256
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch") as e:
        validate_run_padding(run)
    assert e.value.title == "sequence too long"           # not the bare default "error"
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        validate_run_padding(run, layout="packed")        # one sequence is longer than a micro-batch
    run.rollout.max_new_tokens = 150                      # 250 -> 256 fits
    assert validate_run_padding(run) == []
    assert validate_run_padding(run, layout="packed") == []


def test_a_multi_turn_row_too_long_for_the_budget_names_the_trajectory_budget():
    """A multi-turn row is the prompt plus the whole trajectory (max_turns x max_new_tokens when
    rollout.max_trajectory_tokens is 0): the refusal gives that length and the keys that set it."""
    from engine.config.lengths import longest_sequence
    from engine.config.load import load_run_config

    keys = ["task=tool_add", "rollout.max_turns=4", "rollout.max_new_tokens=12", "data.max_prompt_length=64"]
    assert longest_sequence(load_run_config(keys).config) == 64 + 4 * 12
    with pytest.raises(ConfigError) as e:  # the run's validation, as `rl train` runs it
        load_run_config([*keys, "engine.max_tokens_per_micro_batch=100"])
    assert "= 112 tokens" in str(e.value) and "rollout.max_trajectory_tokens" in str(e.value)
    assert "rollout.max_new_tokens =" not in str(e.value)


def test_bucket_not_a_multiple_of_the_parallel_alignment_is_rounded_not_refused():
    """bucket=10 with SP over tp=4 is fine: every boundary is a multiple of lcm = 20."""
    cfg = MegatronEngineConfig(pad_to_length=True, pad_to_length_bucket=10, tensor_model_parallel_size=4,
                               sequence_parallel=True, max_tokens_per_micro_batch=200)
    assert validate_padding_config(cfg) == []
    assert all(b % 20 == 0 for b in make_bucket_policy(cfg).boundaries())


def test_compile_without_padding_warns():
    assert any("recompiles" in w for w in validate_padding_config(FSDPEngineConfig(compile=True)))


def test_incompatible_learned_checkpoint_state_is_refused():
    """Resuming learned boundaries needs the same policy, alignment and room for every boundary."""
    p = LearnedPolicy(alignment=16, max_length=1024, max_shapes=6, refresh_steps=1)
    p.observe(long_tailed(random.Random(0), 400, 100, 1024))
    p.maybe_refresh(1)
    p.maybe_refresh(2)
    state = json.loads(json.dumps(p.state_dict()))
    assert len(state["boundaries"]) >= 4
    with pytest.raises(ConfigError, match="max_shapes>="):
        LearnedPolicy(alignment=16, max_length=1024, max_shapes=2, refresh_steps=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="not multiples"):
        LearnedPolicy(alignment=48, max_length=1024, max_shapes=8, refresh_steps=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="pad_to_length_policy"):
        make_bucket_policy(FSDPEngineConfig(pad_to_length=True)).load_state_dict(state)
