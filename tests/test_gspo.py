"""GSPO (``algorithm.loss=gspo``, engine/algorithms/gspo.py): the sequence-level importance ratio
s_i = exp(mean_t(log pi - log pi_old)) over each response, clipped per response.

What is checked, each against numbers or formulas written here:
- a two-response example computed by hand (loss, gradient, metrics, for both aggregations GSPO
  takes);
- on-policy (old == current) every s_i is 1 and GSPO's loss and gradient equal PPO-clip's under the
  same aggregation, for per-sequence and per-token advantages (from d s_it / d log pi_it = s_i = 1);
- the FSDP engine's gradient equals a plain-PyTorch GSPO loss written as the paper's *sequence*
  objective (gradient through the mean log-ratio, no GSPO-token form) for every per-response
  estimator, the paper's GSPO-token formula for the per-token ones (ppo, reinforce_pp), and with the
  KL and entropy terms; micro-batches split the batch and the all-equal group is skipped;
- the megatron engine (TP=2, vocabulary-parallel log-probs) steps like the same formula;
- the step's sequence-ratio metrics (mean over every response, min/max combined as extremes over
  micro-batches, ranks and updates);
- config refusals (exit 2) and a short `rl train` that logs the metrics.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.dist_utils import full_tensor, run_ranks
from tests.test_update_parity import EOS, G, MAX_NEW, PAD, REWARDS, VOCAB, _batch, _group_baseline_advantages, \
    _ppo_advantages


def _loss(**cfg):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.config.schema import AlgorithmConfig

    return PolicyLoss(AlgorithmConfig(**cfg))


def _rows(mask, adv, old):
    from engine.batch import SequenceBatch

    B, T = mask.shape
    b = SequenceBatch(torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long), mask,
                      torch.ones(B, dtype=torch.long))
    b.advantages, b.old_log_probs = adv, old
    return b


# ---- by hand ---------------------------------------------------------------------------------------
def test_two_responses_by_hand():
    """Response 0: 3 tokens, log-ratios 0.3, -0.1, 0.1 (mean 0.1), A = 1. Response 1: 2 tokens,
    log-ratios -0.2, 0.0 (mean -0.1), A = 2. Clip range [0.95, 1.05].

    s_0 = e^0.1 = 1.105171 > 1.05 and A > 0: the clipped term -1.05 is the larger, l_0 = -1.05, no gradient.
    s_1 = e^-0.1 = 0.904837 < 0.95 but A > 0: the lower clip does not bind, l_1 = -2 * 0.904837 = -1.809675.
    seq-mean-token-mean: (l_0 + l_1) / 2 = -1.429837; d/d log pi(y_1t) = -A s_1 / |y_1| / 2 = -0.452419.
    token-mean: (3 l_0 + 2 l_1) / 5 = -1.353870; d/d log pi(y_1t) = -A s_1 / 5 = -0.361935.
    The log-prob of response 1's pad column is -inf: it is off the mask and must not turn into nan."""
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    adv = torch.tensor([[0.0, 1, 1, 1], [0, 2, 2, 0]])
    lp0 = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0, -1.5, -0.7, -math.inf]])
    old = torch.tensor([[0.0, -1.3, -1.9, -0.6], [0, -1.3, -0.7, 0]])
    s0, s1 = math.exp(0.1), math.exp(-0.1)
    want = {"seq-mean-token-mean": (-(1.05 + 2 * s1) / 2, -2 * s1 / 2 / 2, 0.5),
            "token-mean": (-(3 * 1.05 + 2 * 2 * s1) / 5, -2 * s1 / 5, 3 / 5)}
    for mode, (loss_want, grad_want, clip_frac) in want.items():
        lp = lp0.clone().requires_grad_(True)
        loss, m = _loss(loss="gspo", loss_agg_mode=mode, gspo_clip_ratio_low=0.05,
                        gspo_clip_ratio_high=0.05)(lp, None, _rows(mask, adv, old), 5.0, 2.0)
        loss.backward()
        assert loss.item() == pytest.approx(loss_want, abs=1e-6) and m["pg_loss"] == pytest.approx(loss_want, abs=1e-6)
        want_grad = torch.tensor([[0.0, 0, 0, 0], [0, grad_want, grad_want, 0]])
        assert torch.allclose(lp.grad, want_grad, atol=1e-6), (mode, lp.grad)
        assert m["seq_ratio_mean"] == pytest.approx((s0 + s1) / 2, abs=1e-6)
        assert m["seq_ratio_min"] == pytest.approx(s1, abs=1e-6) and m["seq_ratio_max"] == pytest.approx(s0, abs=1e-6)
        assert m["seq_clip_frac"] == pytest.approx(0.5)  # response 0 clipped, response 1 not
        assert m["clip_frac"] == pytest.approx(clip_frac)  # the clipped tokens, aggregated like the loss


def test_on_policy_gspo_is_ppo_clip():
    """old == current: s_i = 1 for every response, nothing is clipped, and each token's gradient is
    -A_it times its aggregation weight, as PPO-clip's (ratio 1, d ratio / d log pi = 1): the first
    update of an RL step equals GRPO's under the same loss_agg_mode, whatever the advantages."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 7)
    for i, (a, b) in enumerate([(1, 7), (2, 4), (3, 6), (1, 2)]):
        mask[i, a:b] = 1
    per_seq = torch.randn(4, 1, generator=g) * mask
    per_tok = torch.randn(4, 7, generator=g) * mask
    base = torch.randn(4, 7, generator=g) - 2
    for adv in (per_seq, per_tok):
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            grads, losses = [], []
            for kind in ("ppo_clip", "gspo"):
                lp = base.clone().requires_grad_(True)
                loss, m = _loss(loss=kind, loss_agg_mode=mode)(lp, None, _rows(mask, adv, base.clone()),
                                                                float(mask.sum()), 4.0)
                loss.backward()
                grads.append(lp.grad)
                losses.append(loss.item())
                if kind == "gspo":
                    assert m["seq_ratio_min"] == m["seq_ratio_max"] == pytest.approx(1.0, abs=1e-7)
                    assert m["seq_clip_frac"] == 0.0
            assert losses[0] == pytest.approx(losses[1], abs=1e-6), mode
            assert torch.allclose(grads[0], grads[1], atol=1e-7), mode
    # and off-policy they differ (the check above is not vacuous)
    lp = base.clone().requires_grad_(True)
    old = base + 0.1 * torch.randn(4, 7, generator=g)
    a, _ = _loss(loss="gspo")(lp, None, _rows(mask, per_seq, old), float(mask.sum()), 4.0)
    b, _ = _loss(loss="ppo_clip")(lp, None, _rows(mask, per_seq, old), float(mask.sum()), 4.0)
    assert abs(a.item() - b.item()) > 1e-3


def test_extremes_combine_as_extremes_and_sums_add():
    from engine.metric_sums import add_metrics, mean_over_updates

    acc: dict = {}
    add_metrics(acc, {"seq_ratio_min": 0.9, "seq_ratio_max": 1.1, "pg_loss": 0.5})
    add_metrics(acc, {"seq_ratio_min": 0.95, "seq_ratio_max": 1.3, "pg_loss": 0.25})
    assert acc == {"seq_ratio_min": 0.9, "seq_ratio_max": 1.3, "pg_loss": 0.75}
    assert mean_over_updates(acc, 3) == {"seq_ratio_min": 0.9, "seq_ratio_max": 1.3, "pg_loss": 0.25}


# ---- the engine against plain PyTorch --------------------------------------------------------------
# name -> (rl overrides, loss_agg_mode, clip low, clip high); "token" cases: per-token advantages
CASES = {
    "grpo-seq-mean-token-mean": (["algorithm.name=grpo"], "seq-mean-token-mean", 0.01, 0.015),
    "grpo-token-mean": (["algorithm.name=grpo"], "token-mean", 0.01, 0.015),
    "rloo": (["algorithm.name=rloo"], "seq-mean-token-mean", 0.01, 0.015),
    "dr_grpo": (["algorithm.name=dr_grpo"], "seq-mean-token-mean", 0.01, 0.015),
    "ppo": (["algorithm.name=ppo"], "seq-mean-token-mean", 0.01, 0.015),
    "grpo-kl-entropy": (["algorithm.name=grpo", "algorithm.kl_coef=1.0", "algorithm.entropy_coef=0.1"],
                        "seq-mean-token-mean", 0.01, 0.015),
}


def _lp_and_entropy(model, batch):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    lp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.cat([torch.zeros(len(lp), 1), lp], 1), torch.cat([torch.zeros(len(ent), 1), ent], 1)


def gspo_reference(lp, old, adv, m, mode, lo, hi, per_token: bool):
    """The paper's objective, negated. Per-response advantages: (1/G) sum_i -min(s_i A_i, clip(s_i) A_i)
    with s_i = exp(mean_t(lp - old)) differentiated as it stands (the sequence form); ``token-mean``
    weighs response i by |y_i| / N instead of 1 / G. Per-token advantages: GSPO-token,
    s_it = sg[s_i] * exp(lp_it - sg[lp_it]), -min(s_it A_it, clip(s_it) A_it), a token mean per response."""
    n = m.sum(-1)
    log_s = ((lp - old) * m).sum(-1) / n
    if per_token:
        s = torch.exp(log_s.detach()[:, None] + lp - lp.detach())
        tok = torch.maximum(-adv * s, -adv * s.clamp(1 - lo, 1 + hi))
        per_seq = (tok * m).sum(-1) / n
    else:
        a = adv.sum(-1) / n  # the one advantage of each response
        s = torch.exp(log_s)
        per_seq = torch.maximum(-a * s, -a * s.clamp(1 - lo, 1 + hi))
    if mode == "token-mean":
        return (per_seq * n).sum() / n.sum()
    return per_seq.mean()


def _engine_cases(rank, world, names):
    import transformers

    from engine.algorithms.estimators import compute_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config

    results = {}
    for name in names:
        overrides, mode, lo, hi = CASES[name]
        extra = [] if "kl" in name else ["algorithm.kl_coef=0", "algorithm.entropy_coef=0"]
        cfg = load_run_config(overrides + extra + [
            "algorithm.loss=gspo", f"algorithm.loss_agg_mode={mode}", f"algorithm.gspo_clip_ratio_low={lo}",
            f"algorithm.gspo_clip_ratio_high={hi}", "optim.grad_clip=0", f"algorithm.rollout_n={G}",
            "engine.micro_batch_size=5", f"rollout.max_new_tokens={MAX_NEW}"]).config
        eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
        eng.build()
        ref = transformers.AutoModelForCausalLM.from_config(eng.model.config)
        ref.load_state_dict({k: full_tensor(v).detach().clone() for k, v in eng.export_hf_state_dict().items()})
        ref.get_input_embeddings().padding_idx = None
        batch = _batch()
        rewards = torch.tensor(REWARDS)
        mask = batch.response_mask
        values = None
        if name == "ppo":
            values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
            adv = _ppo_advantages(rewards, mask, values)
        else:
            adv = _group_baseline_advantages(cfg.algorithm.name, rewards)[:, None] * mask
        got = compute_advantages(cfg.algorithm, rewards, mask, G, values=values, max_len=MAX_NEW)
        with torch.no_grad():
            lp, _ = _lp_and_entropy(ref, batch)
        # old log-probs: the current ones moved per token, so that some responses' ratios leave
        # [1 - lo, 1 + hi] and some stay inside
        noise = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) - 0.5) * 0.2
        old = (lp + noise) * mask
        batch.advantages, batch.old_log_probs = got.advantages, old
        if name == "ppo":
            batch.values, batch.returns = values, got.returns
        lp_g, ent = _lp_and_entropy(ref, batch)
        ref_loss = gspo_reference(lp_g, old, adv, mask, mode, lo, hi, per_token=name == "ppo")
        if "kl" in name:
            ref_lp = (lp + (torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) - 0.5) * 0.4) * mask
            batch.ref_log_probs = ref_lp
            d = lp_g - ref_lp  # low_var_kl: k3 clamped to [-10, 10], a token mean per response
            k3 = (torch.exp(-d) + d - 1).clamp(-10, 10)
            ref_loss = ref_loss + 1.0 * ((k3 * mask).sum(-1) / mask.sum(-1)).mean() \
                - 0.1 * ((ent * mask).sum(-1) / mask.sum(-1)).mean()
        ref_loss.backward()
        s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
        a = adv.sum(-1) / mask.sum(-1)
        trained = a != 0
        clipped = (((s > 1 + hi) & (a > 0)) | ((s < 1 - lo) & (a < 0))) & trained
        grads = {}
        step = eng.optimizer.step

        def capture(*args, **kw):
            for n, p in eng.model.named_parameters():
                grads[n] = full_tensor(p.grad).detach().clone()
            return step(*args, **kw)

        eng.optimizer.step = capture
        stats = eng.train_step(batch, PolicyLoss(cfg.algorithm, world))
        ref_grads = dict(ref.named_parameters())
        num = den = 0.0
        for n, g in grads.items():
            r = ref_grads[n.replace("_fsdp_wrapped_module.", "").replace("_orig_mod.", "")].grad
            num += float((g - r).pow(2).sum())
            den += float(r.pow(2).sum())
        results[name] = {"grad_rel_err": (num / den) ** 0.5, "grad_norm": den ** 0.5, "params": len(grads),
                         "adv_err": float((got.advantages - adv).abs().max()), "metrics": stats.metrics,
                         "s": s.tolist(), "clipped": int(clipped.sum()), "unclipped": int((~clipped & trained).sum())}
    return results


@pytest.fixture(scope="module")
def engine_results():
    return run_ranks(_engine_cases, 1, list(CASES))[0]


@pytest.mark.parametrize("name", list(CASES))
def test_engine_gradient_equals_the_gspo_formula(engine_results, name):
    r = engine_results[name]
    assert r["params"] > 10 and r["adv_err"] < 1e-5, r
    if name != "ppo":  # the clip is active on some responses and not on others
        assert r["clipped"] > 0 and r["unclipped"] > 0, r
    assert r["grad_norm"] > 1e-4, r
    assert r["grad_rel_err"] < 1e-4, r
    m, s = r["metrics"], r["s"]
    assert m["seq_ratio_mean"] == pytest.approx(sum(s) / len(s), abs=1e-5)  # every response, skipped ones too
    assert m["seq_ratio_min"] == pytest.approx(min(s), abs=1e-5)
    assert m["seq_ratio_max"] == pytest.approx(max(s), abs=1e-5)
    if name.startswith("grpo") and "kl" not in name:
        assert m["rows_skipped"] == G  # the all-equal group trained nothing and its backward was skipped
        # the responses whose sequence ratio was clipped, over all 12 (a skipped response is never clipped)
        assert m["seq_clip_frac"] == pytest.approx(r["clipped"] / len(s), abs=1e-6)


# ---- megatron ---------------------------------------------------------------------------------------
def _megatron_gspo(rank, world):
    pytest.importorskip("megatron.core")
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.megatron import cpu_shim
    from tests import test_megatron as tm

    cpu_shim.apply()
    cfg = tm._run_cfg(tp=2)
    cfg.algorithm.loss, cfg.algorithm.loss_agg_mode = "gspo", "seq-mean-token-mean"
    cfg.algorithm.gspo_clip_ratio_low, cfg.algorithm.gspo_clip_ratio_high = 0.02, 0.02
    eng = tm._engine(cfg, world)
    batch = tm._batch(0)
    lp, _ = eng.compute_log_probs(batch)
    # old log-probs: per-token noise with mean 0 over each response, plus a shift that puts the
    # first three responses' ratios outside [0.98, 1.02] on the side where the clip binds (s_i > 1.02
    # when A_i > 0, s_i < 0.98 when A_i < 0) and the other three inside
    m = batch.response_mask
    noise = torch.randn(m.shape, generator=torch.Generator().manual_seed(5)) * 0.2 * m
    noise = (noise - (noise.sum(-1, keepdim=True) / m.sum(-1, keepdim=True))) * m
    a = batch.advantages.sum(-1) / m.sum(-1)
    log_s = torch.tensor([0.05, 0.05, 0.05, 0.01, -0.01, 0.0]) * torch.sign(a)
    batch.old_log_probs = (lp + noise - log_s[:, None]) * m
    eng.train_step(batch, PolicyLoss(cfg.algorithm, eng.dp_size))
    lo = hi = 0.02

    def reference(lp_, ent, mb, n_tok, n_seqs):
        return gspo_reference(lp_, mb.old_log_probs, mb.advantages, mb.response_mask, "seq-mean-token-mean", lo, hi,
                              per_token=False), {}

    ref_exp_avg, _ = tm._hf_reference_step(cfg, batch, reference)
    state = eng.checkpoint_state()
    scale = max(float(v.abs().max()) for v in ref_exp_avg.values())
    s = torch.exp(((lp - batch.old_log_probs) * m).sum(-1) / m.sum(-1))
    clipped = ((s > 1 + hi) & (a > 0)) | ((s < 1 - lo) & (a < 0))
    return {"grad_rel_err": max(float((state["optim"][f"state.{k}.exp_avg"] - v).abs().max())
                                for k, v in ref_exp_avg.items()) / scale,
            "scale": scale, "clipped": int(clipped.sum()), "rows": len(s)}


@pytest.mark.megatron
def test_megatron_tp2_gspo_step_equals_the_formula():
    """Two gloo ranks, TP=2: the loss sees log-probs gathered from vocabulary-parallel logits; the
    optimizer's first moment after one step (the clipped gradient times 1 - beta1) equals plain
    transformers + AdamW stepping the GSPO sequence objective."""
    pytest.importorskip("megatron.core")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    r = run_ranks(_megatron_gspo, 2)[0]
    assert r["clipped"] == 3 and r["rows"] == 6, r  # the clip is active on three responses
    assert r["scale"] > 0 and r["grad_rel_err"] < 1e-5, r


# ---- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.loss=gspo", "algorithm=rloo"], r"loss_agg_mode=seq-mean-token-sum.*algorithm=rloo.*sets it"),
    (["algorithm.loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-sum"], r"seq-mean-token-mean"),
    (["algorithm.loss=gspo", "algorithm.gspo_clip_ratio_low=1.0"], r"gspo_clip_ratio_low.*must be < 1"),
    (["algorithm.gspo_clip_ratio_high=0.01"], r"read only by `algorithm.loss=gspo`"),
    (["algorithm.loss=gspo_token"], r"algorithm.loss"),
    (["algorithm.clip_ratio_c=1.0"], r"clip_ratio_c=1.0.*must be above 1"),
    (["algorithm.loss=gspo", "algorithm.clip_ratio_c=3"], r"clip_ratio_c.*dual-clip.*gspo"),
])
def test_config_refusals(overrides, needle):
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_run_config(overrides)


def test_config_accepts_gspo_with_every_estimator():
    from engine.config.load import load_run_config

    for algo in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "dapo", "ppo"):
        a = load_run_config([f"algorithm={algo}", "algorithm.loss=gspo",
                             "algorithm.loss_agg_mode=seq-mean-token-mean"]).config.algorithm
        assert (a.loss, a.gspo_clip_ratio_low, a.gspo_clip_ratio_high) == ("gspo", 3e-4, 4e-4)
    assert load_run_config(["algorithm.loss=gspo"]).config.algorithm.loss_agg_mode == "token-mean"


def test_refusal_exits_2_with_one_paragraph():
    from tests.cli_utils import cli, flat

    r = cli("train", "algorithm=dr_grpo", "algorithm.loss=gspo")
    assert r.exit_code == 2, r.output
    assert "algorithm.loss_agg_mode=seq-mean-token-mean" in flat(r.output) and "Traceback" not in r.output


@pytest.mark.slow
def test_rl_train_with_gspo_logs_the_sequence_ratio(tmp_path):
    """Four mini-batches per step (the paper's setting): from the second on, old != current, so the
    ratios move off 1 and some responses are clipped; metrics.jsonl carries them under algo."""
    import json

    from tests.cli_utils import rl

    d = tmp_path / "run"
    r = rl("train", "algorithm.loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean", "trainer.total_steps=3",
           "data.train_batch_size=8", "algorithm.ppo_mini_batch_size=2", f"checkpoint.dir={d}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 3
    for row in rows:
        a = row["algo"]
        assert a["seq_ratio_min"] <= a["seq_ratio_mean"] <= a["seq_ratio_max"], a
        assert 0.0 <= a["seq_clip_frac"] <= 1.0 and row["clip_frac"] is not None
    assert any(row["algo"]["seq_ratio_max"] > 1.0 or row["algo"]["seq_ratio_min"] < 1.0 for row in rows)
