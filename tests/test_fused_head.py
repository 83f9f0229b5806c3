"""engine.fused_lm_head: the output layer computing the log-probs inside the model's forward
(engine/backends/fused_head.py) gives the log-softmax of the model's own logits and the same
gradients for every parameter, in the plain forward and in the prompt-grouped one (each distinct
prompt once, its last position handed to every sample inside the output layer); an FSDP2 step on
two gloo ranks, with the output layer in the root unit (gathered only inside the forward) and the
prompts grouped, equals a plain one-rank step of the plain forward, and its no-grad pass (old
and reference log-probs) gives the formula's log-probs and entropy without making the logits;
models whose forward changes the logits after the output layer are refused."""

from __future__ import annotations

import torch

from engine.algorithms.logprobs import token_log_probs
from engine.config.load import load_run_config
from engine.backends.fused_head import head_log_probs, response_positions, unfusable_reason
from engine.backends.prompt_sharing import grouped_logits
from engine.batching.prompt_groups import group_prompts, to_response_columns
from tests.dist_utils import run_ranks
from tests.test_rollout_speed_update import EOS, PAD, VOCAB, _model, _rollout


def _formula(model, batch, mask=None):
    """The float64 formula on the model's own logits at temperature 0.7: each position's log-prob
    of the next token and entropy (times ``mask`` [B, T-1] when given), the loss
    sum(lp * advantage) + 0.1 * sum(entropy), and its gradient for every parameter."""
    ids = batch.input_ids
    logits = model(input_ids=ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logp_all = torch.log_softmax(logits.double()[:, :-1] / 0.7, dim=-1)
    ref_lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    if mask is not None:
        ref_lp, ref_ent = ref_lp * mask, ref_ent * mask
    ref_loss = (ref_lp * batch.advantages[:, 1:]).sum() + 0.1 * ref_ent.sum()
    return ref_lp.detach(), ref_ent.detach(), ref_loss.detach(), torch.autograd.grad(ref_loss, list(model.parameters()))


def _assert_gradients(model, loss, ref_grads):
    for (name, _), a, b in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters())),
                               ref_grads):
        err = float((a.double() - b).abs().max())
        assert err <= 1e-6 * float(b.abs().max()) + 1e-6, (name, err)  # fp32 against the float64 formula


def test_the_fused_forward_gives_the_log_softmax_and_gradients_of_the_models_logits():
    batch = _rollout()
    model = _model().train()
    ids, attn = batch.input_ids, batch.attention_mask
    ref_lp, ref_ent, _, ref_grads = _formula(model, batch)

    target = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    with head_log_probs(model, target, 0.7, chunk_tokens=5, entropy_grad=True):
        out = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    assert out.shape == ids.shape + (2,)
    assert "forward" not in model.lm_head.__dict__  # the output layer is itself again after the block
    lp, ent = out[:, :-1, 0], out[:, :-1, 1]
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    _assert_gradients(model, (lp.double() * batch.advantages[:, 1:]).sum() + 0.1 * ent.double().sum(), ref_grads)


def test_the_output_layer_computes_only_the_response_tokens_and_their_gradients_are_the_formulas():
    """With ``positions`` (the response-predicting positions) the output layer computes those
    alone: the float64 formula there, exactly 0 at every other position, and the gradients of a
    loss over the response tokens equal the formula's for every parameter."""
    batch = _rollout()
    model = _model().train()
    ids, attn = batch.input_ids, batch.attention_mask
    mask = batch.response_mask[:, 1:].double()
    ref_lp, ref_ent, _, ref_grads = _formula(model, batch, mask)

    where = response_positions(batch.response_mask)
    assert 0 < where.numel() == int(batch.response_mask[:, 1:].sum()) < ids.numel()
    target = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    with head_log_probs(model, target, 0.7, chunk_tokens=5, entropy_grad=True, positions=where):
        out = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    lp, ent = out[:, :-1, 0].double(), out[:, :-1, 1].double()
    assert not (lp * (1 - mask)).any() and not (ent * (1 - mask)).any() and not out[:, -1].any()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    _assert_gradients(model, (lp * batch.advantages[:, 1:]).sum() + 0.1 * ent.sum(), ref_grads)
    # a micro-batch with no response token (a zero-weight twin) still goes through the layer
    assert response_positions(torch.zeros(2, 5)).tolist() == [0]


def test_the_grouped_fused_forward_gives_the_log_softmax_and_gradients_at_every_response_token():
    """The formula on the plain forward's logits (float64 log-softmax at each response token's
    position, with an entropy bonus) against the grouped forward whose output layer computes
    them: the prompt pass runs each distinct prompt once and its last position predicts every
    sample's own first token."""
    batch = _rollout()
    model = _model().train()
    ref_lp, ref_ent, ref_loss, ref_grads = _formula(model, batch, batch.response_mask[:, 1:].double())

    groups = group_prompts(batch, PAD)
    assert groups is not None and groups.num_prompts < len(batch)  # the prompts are shared
    cols = to_response_columns(batch, groups)
    out = grouped_logits(model, groups, "cpu", head=lambda target, rows: head_log_probs(
        model, target, 0.7, chunk_tokens=5, entropy_grad=True, rows=rows))
    assert out.shape == cols.input_ids.shape + (2,)
    assert "forward" not in model.lm_head.__dict__
    m = cols.response_mask.double()
    lp, ent = out[..., 0].double() * m, out[..., 1].double() * m
    # column j of the response layout is position prompt_len + j of the plain layout, predicted by the one before
    torch.testing.assert_close(lp, ref_lp.gather(1, groups.cols - 1) * m, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.gather(1, groups.cols - 1) * m, rtol=0, atol=1e-5)
    loss = (lp * cols.advantages).sum() + 0.1 * ent.sum()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    _assert_gradients(model, loss, ref_grads)


def _step(rank, world, batch, fused: bool, share: bool | None = None):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.trainer.worker_group import shard_slices

    cfg = load_run_config(["engine.micro_batch_size=4", "algorithm.entropy_coef=0.01", "engine.fsdp_unit=layer",
                           f"engine.fused_lm_head={str(fused).lower()}", "engine.logprob_chunk_tokens=7"]).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    share = fused if share is None else share  # the reference is the plain forward
    eng.share_prompts = share
    assert eng._share_prompts() == share
    weights = {k: v.clone() for k, v in eng.export_hf_state_dict().items()}  # before the step
    passed = eng.compute_log_probs(batch, with_entropy=True)  # the no-grad pass (old/reference log-probs)
    lp_only, none = eng.compute_log_probs(batch)  # as the old/reference passes ask: no entropy computed
    assert none is None and torch.equal(lp_only, passed[0])
    stats = eng.train_step(batch.select(shard_slices(len(batch), world)[rank]), PolicyLoss(cfg.algorithm, world))
    return {k: v.clone() for k, v in eng.export_hf_state_dict().items()}, stats.metrics, stats.replicated, \
        weights, passed


def _steps(rank, world, batch):
    """The fused step with the prompts grouped, then without (the output layer on the response
    positions alone), on the same ranks."""
    return [_step(rank, world, batch, True, share) for share in (True, False)]


def test_fsdp2_step_with_the_fused_output_layer_equals_the_plain_step():
    """Two ranks, every decoder layer its own FSDP2 unit and the output layer in the root unit,
    with an entropy bonus (its gradient goes through the fused backward too), the prompts grouped
    and not: the same weights after one step as one rank's plain step of the plain forward
    (tolerance as tests/test_fsdp_engine.py: 2e-5)."""
    batch = _rollout(n=4)
    (plain, m_plain, r_plain, start, _), = run_ranks(_step, 1, batch, False)
    both = run_ranks(_steps, 2, batch)
    for two in ([r[0] for r in both], [r[1] for r in both]):
        _check_fused_ranks(batch, plain, m_plain, r_plain, start, two)


def _check_fused_ranks(batch, plain, m_plain, r_plain, start, two):
    for k in plain:
        assert torch.allclose(plain[k], two[0][0][k], atol=2e-5), (k, (plain[k] - two[0][0][k]).abs().max())
    assert abs(r_plain["grad_norm"] - two[0][2]["grad_norm"]) < 1e-4
    assert abs(sum(t[1]["pg_loss"] for t in two) - m_plain["pg_loss"]) < 1e-5

    # the no-grad pass through the fused output layer on both ranks: the formula on the model's
    # own logits (float64 log-softmax at the rollout temperature, 0 at position 0 and on padding)
    from engine.model.build import build_hf_model

    cfg = load_run_config([]).config
    model = build_hf_model(cfg.model, "", VOCAB, cfg.trainer.seed, PAD, EOS)
    model.load_state_dict(start)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logp = torch.log_softmax(logits.double()[:, :-1] / cfg.rollout.temperature, dim=-1)
    mask = batch.response_mask[:, 1:].double()  # the output layer computes the response tokens' alone
    want_lp = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * mask
    want_ent = -(logp.exp() * logp).sum(-1) * mask
    for *_, (lp, ent) in two:
        assert not lp[:, 0].any() and not ent[:, 0].any()
        assert not (lp[:, 1:] * (1 - mask)).any() and not (ent[:, 1:] * (1 - mask)).any()  # prompt positions: 0
        torch.testing.assert_close(lp[:, 1:].double(), want_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent[:, 1:].double(), want_ent, rtol=0, atol=1e-5)


def test_models_that_change_their_logits_or_have_an_adapted_head_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    assert unfusable_reason(_model()) == ""
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB))
    assert "GPT2LMHeadModel is not one of" in unfusable_reason(gpt2)
    llama = _model()
    llama.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert "with a bias" in unfusable_reason(llama)


def test_the_estimate_counts_no_logits_in_any_pass_with_the_fused_output_layer():
    """engine.fused_lm_head: the update and the no-grad passes hold only the fp32 working set of
    one chunk of positions (logprob_chunk_tokens x vocab x 8 B: the product and its exp); without
    it the no-grad passes hold the micro-batch's logits in the model's dtype on top."""
    from engine.memory.estimate import estimate_memory

    vocab, seq_len, chunk = 1000, 30, 64
    args = ["data.train_batch_size=16", "model.dtype=bfloat16", f"engine.logprob_chunk_tokens={chunk}"]
    fused, plain = (estimate_memory(load_run_config([*args, f"engine.fused_lm_head={on}"]).config, vocab_size=vocab,
                                    seq_len=seq_len) for on in ("true", "false"))
    tokens = fused.assumptions["micro_batch_tokens"]
    assert tokens > chunk
    logits = {(e is fused, p.phase): p.categories["logits"] for e in (fused, plain) for p in e.phases}
    assert logits[True, "old_log_probs"] == chunk * vocab * 8 and logits[True, "update"] == 0
    assert logits[False, "old_log_probs"] == tokens * vocab * 2 + chunk * vocab * 8
    assert logits[False, "update"] == tokens * vocab * 2
