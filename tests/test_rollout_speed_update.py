"""The update's prompt-grouped forward (each distinct prompt once, its KV cache shared by the
group's responses) gives the plain forward's log-probs, gradients and optimizer step."""

from __future__ import annotations

import torch

from engine.algorithms.logprobs import position_log_probs, token_log_probs
from engine.backends.prompt_sharing import grouped_logits
from engine.batching.prompt_groups import group_prompts, to_response_columns
from engine.config.load import load_run_config
from engine.config.schema import ModelConfig
from engine.model.build import build_hf_model
from tests.dist_utils import run_ranks

VOCAB, PAD, EOS = 12, 0, 1
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11, 3], [2]]


def _rollout(n: int = 3, seed: int = 0):
    """Prompt-major rows with different prompt and response lengths, as the sampler makes them."""
    from engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    rows, resp_lens = [p for p in PROMPTS for _ in range(n)], []
    T = max(len(p) for p in PROMPTS) + 6
    ids = torch.full((len(rows), T), PAD)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    rmask = torch.zeros((len(rows), T))
    for i, p in enumerate(rows):
        r = int(torch.randint(1, 7, (1,), generator=g))
        resp_lens.append(r)
        ids[i, :len(p)] = torch.tensor(p)
        ids[i, len(p):len(p) + r] = torch.randint(2, VOCAB, (r,), generator=g)
        attn[i, :len(p) + r] = 1
        rmask[i, len(p):len(p) + r] = 1
    adv = torch.randn(len(rows), generator=g)[:, None] * rmask
    return SequenceBatch(input_ids=ids, attention_mask=attn, response_mask=rmask,
                         prompt_lengths=torch.tensor([len(p) for p in rows]), advantages=adv)


def _model():
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return build_hf_model(cfg, "", VOCAB, seed=1, pad_token_id=PAD, eos_token_id=EOS)


def test_groups_hold_each_distinct_prompt_once():
    batch = _rollout()
    groups = group_prompts(batch, PAD)
    assert groups.num_prompts == len(PROMPTS)
    assert groups.owner.tolist() == [k for k in range(len(PROMPTS)) for _ in range(3)]
    cols = to_response_columns(batch, groups)
    assert torch.equal(cols.response_mask.sum(-1), batch.response_mask.sum(-1))
    assert torch.equal(cols.advantages.sum(-1), batch.advantages.sum(-1))
    distinct = batch.select(slice(0, 12, 3))  # one row per prompt: nothing to share
    assert group_prompts(distinct, PAD) is None


def test_grouped_log_probs_and_gradients_equal_plain_forward():
    batch = _rollout()
    model = _model().train()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    plain, _ = token_log_probs(logits, batch.input_ids, 0.7)
    plain_loss = (plain * batch.advantages).sum()
    plain_grads = torch.autograd.grad(plain_loss, list(model.parameters()))

    groups = group_prompts(batch, PAD)
    cols = to_response_columns(batch, groups)
    lp, _ = position_log_probs(grouped_logits(model, groups, "cpu"), cols.input_ids, 0.7)
    lp = lp * cols.response_mask
    assert torch.allclose(lp, (plain * batch.response_mask).gather(1, groups.cols) * groups.response_mask, atol=1e-5)
    grouped_loss = (lp * cols.advantages).sum()
    assert torch.allclose(grouped_loss, plain_loss, atol=1e-5)
    grouped_grads = torch.autograd.grad(grouped_loss, list(model.parameters()))
    for a, b in zip(plain_grads, grouped_grads):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def _step(rank, world, batch, share: bool):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.trainer.worker_group import shard_slices

    cfg = load_run_config(["engine.micro_batch_size=4", "algorithm.loss_agg_mode=seq-mean-token-mean",
                           "algorithm.entropy_coef=0.01"]).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    eng.share_prompts = share
    stats = eng.train_step(batch.select(shard_slices(len(batch), world)[rank]), PolicyLoss(cfg.algorithm, world))
    return {k: v.clone() for k, v in eng.export_hf_state_dict().items()}, stats.metrics, stats.replicated


def test_fsdp_step_with_grouped_prompts_equals_plain_step():
    """One optimizer step on 2 ranks with the grouped forward equals 1 rank with the plain
    forward (same batch; tolerance as tests/test_fsdp_engine.py: 2e-5)."""
    batch = _rollout(n=4)
    (plain, m_plain, r_plain), = run_ranks(_step, 1, batch, False)
    two = run_ranks(_step, 2, batch, True)
    grouped = two[0][0]
    for k in plain:
        assert torch.allclose(plain[k], grouped[k], atol=2e-5), (k, (plain[k] - grouped[k]).abs().max())
    assert abs(r_plain["grad_norm"] - two[0][2]["grad_norm"]) < 1e-4
    pg = sum(t[1]["pg_loss"] for t in two)
    assert abs(pg - m_plain["pg_loss"]) < 1e-5
