"""trainer.mode=streamed (engine/trainer/streamed_update.py): the ranks update on chunks of prompt
groups as they complete, the loss's normaliser known only after the last chunk.

Protected here:
- the streamed step's gradient is the gradient of the whole batch's loss, computed by hand from
  the formula (token-mean and seq-mean-token-mean), on one rank and on two (one chunk smaller than
  the ranks, so one rank runs an empty share), and its metrics are the whole batch's;
- what the mode cannot stream is refused with the reason and the fix;
- (slow, in tests/test_rollout_ahead.py's runs) a real run samples every row with the weights it
  trains, and resumes exactly.
"""

from __future__ import annotations

import pytest
import torch

from engine.config.load import load_run_config
from engine.metric_sums import add_metrics
from tests.dist_utils import full_tensor, run_ranks
from tests.cli_utils import rl

VOCAB, PAD, EOS = 12, 0, 1
CHUNKS = [slice(0, 5), slice(5, 6), slice(6, 10)]  # rows; the 1-row chunk leaves one of two ranks empty


def _batch():
    from engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(0)
    B, T = 10, 11
    ids = torch.randint(2, VOCAB, (B, T), generator=g)
    lengths = torch.tensor([11, 7, 9, 5, 10, 6, 8, 4, 11, 9])
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    resp = attn.float().clone()
    resp[:, :3] = 0
    adv = torch.randn(B, generator=g)[:, None] * resp
    adv[3] = 0  # a row that trains nothing (skipped by the engine, still in the counts)
    return SequenceBatch(input_ids=ids * attn, attention_mask=attn, response_mask=resp,
                         prompt_lengths=torch.full((B,), 3), advantages=adv)


def _streamed(rank, world, batch, agg):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.trainer.worker_group import empty_share, shard_slices

    cfg = load_run_config(["engine.micro_batch_size=2", f"algorithm.loss_agg_mode={agg}", "optim.grad_clip=0",
                           "rollout.temperature=1.0"]).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    before = {k: v.clone() for k, v in eng.export_hf_state_dict().items()}
    grads = {}
    step = eng._clip_and_step

    def capture(model, optimizer, clip):
        for name, p in model.named_parameters():
            grads[name] = full_tensor(p.grad).clone()
        return step(model, optimizer, clip)

    eng._clip_and_step = capture
    loss = PolicyLoss(cfg.algorithm, world)
    eng.stream_begin()
    for rows in CHUNKS:
        chunk = batch.select(rows)
        share = shard_slices(len(chunk), world)[rank]
        eng.stream_chunk(chunk.select(share) if share.stop > share.start else empty_share(chunk), loss)
    stats = eng.stream_finish(float(batch.response_mask.sum()), float(len(batch)), loss)
    return before, grads, stats.metrics, stats.replicated["grad_norm"]


def _by_hand(weights, batch, agg):
    """The whole batch's loss from the formula, at ratio 1 (old = current policy): the PPO-clip
    term is -A * ratio, so its gradient is -A * grad log p; averaged over the batch's response tokens
    (token-mean) or over its sequences of each one's token mean (seq-mean-token-mean)."""
    from engine.config.load import load_run_config
    from engine.model.build import build_hf_model

    cfg = load_run_config([]).config
    model = build_hf_model(cfg.model, "", VOCAB, cfg.trainer.seed, PAD, EOS)
    model.load_state_dict(weights, strict=False)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    logp = torch.zeros(batch.input_ids.shape)
    logp[:, 1:] = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = torch.zeros(batch.input_ids.shape)
    ent[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)
    m, a = batch.response_mask, batch.advantages
    per_token = -a * m
    if agg == "token-mean":
        loss = (per_token * logp).sum() / m.sum()
        pg = per_token.sum() / m.sum()
    else:
        loss = ((per_token * logp).sum(-1) / m.sum(-1)).sum() / len(m)
        pg = (per_token.sum(-1) / m.sum(-1)).sum() / len(m)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {"pg_loss": float(pg), "entropy": float((ent.detach() * m).sum() / m.sum()), "clip_frac": 0.0}


def _streamed_each(rank, world, batch, aggs):
    """``_streamed`` for each loss aggregation in ``aggs``, in one process (one spawn of the ranks)."""
    return [_streamed(rank, world, batch, agg) for agg in aggs]


def test_streamed_gradient_is_the_whole_batch_gradient_by_the_formula():
    """token-mean on 1 and 2 ranks, seq-mean-token-mean on 2."""
    batch = _batch()
    for world, aggs in ((1, ("token-mean",)), (2, ("token-mean", "seq-mean-token-mean"))):
        per_rank = run_ranks(_streamed_each, world, batch, aggs)
        for i, agg in enumerate(aggs):
            out = [r[i] for r in per_rank]
            before, grads, _, norm = out[0]
            metrics = {}
            for rank in out:  # each rank reports its share of the global aggregate (engine/metric_sums.py)
                add_metrics(metrics, rank[2])
            want, want_metrics = _by_hand(before, batch, agg)
            matched = 0
            for name, g in grads.items():
                key = next((k for k in want if name.endswith(k)), None)
                assert key is not None, name
                assert torch.allclose(g, want[key], atol=1e-6, rtol=1e-4), (world, agg, name, (g - want[key]).abs().max())
                matched += 1
            assert matched == len(want)
            assert norm == pytest.approx(float(torch.sqrt(sum((g ** 2).sum() for g in want.values()))), rel=1e-4)
            for k, v in want_metrics.items():
                assert metrics[k] == pytest.approx(v, abs=1e-5), (world, agg, k)
            assert metrics["rows_skipped"] == 1  # row 3 (advantage 0) ran no backward
            if world == 2:
                assert all(torch.equal(grads[k], out[1][1][k]) for k in grads)  # every rank the same step


def test_every_metric_of_the_loss_has_a_denominator():
    """A metric the streamed step could not divide by its count would be silently wrong: each
    metric the loss reports, in every configuration that streams, has its rule."""
    from engine.algorithms.policy_loss import PolicyLoss

    for over in ([], ["algorithm.loss=gspo"], ["algorithm.clip_ratio_c=3"], ["algorithm.kl_coef=0.1"],
                 ["algorithm.entropy_coef=0.01", "algorithm.loss_agg_mode=seq-mean-token-sum"]):
        cfg = load_run_config(over).config
        loss = PolicyLoss(cfg.algorithm)
        b = _batch()
        b.rollout_log_probs = torch.randn(b.input_ids.shape) * b.response_mask
        b.ref_log_probs = torch.randn(b.input_ids.shape) * b.response_mask
        lp = torch.randn(b.input_ids.shape)
        _, metrics = loss(lp, torch.rand(b.input_ids.shape), b, 1.0, 1.0)
        for key in metrics:
            assert loss.metric_denominator(key) in ("tokens", "seqs", None), (over, key)
    with pytest.raises(KeyError):
        PolicyLoss(load_run_config([]).config.algorithm).metric_denominator("a_new_metric")


@pytest.mark.parametrize("overrides, words", [
    (["engine=megatron"], "engine=fsdp"),
    (["rollout=vllm"], "rollout=torch"),
    (["algorithm.name=ppo"], "critic"),
    (["algorithm.name=reinforce_pp"], "whitened"),
    (["algorithm.ppo_epochs=2"], "algorithm.ppo_epochs=1"),
    (["rollout.micro_batch_size=3", "algorithm.rollout_n=2"], "multiple of 2"),
    (["trainer.stream_groups=true"], "Drop trainer.stream_groups"),
])
def test_what_cannot_stream_is_refused_with_the_fix(overrides, words):
    r = rl("train", "trainer.mode=streamed", *overrides, "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr and "trainer.mode=streamed" in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_one_step_off_with_stream_groups_points_to_streamed():
    r = rl("train", "trainer.mode=one_step_off", "trainer.stream_groups=true", "--dry-run")
    assert r.returncode == 2 and "trainer.mode=streamed" in r.stderr, r.stderr
