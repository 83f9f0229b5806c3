"""algorithm.off_policy_ratio=snis (engine/algorithms/snis.py), checked against what it exists for.

Samples drawn by older weights pi_b are reweighted within each prompt group by their
self-normalised sequence ratio pi_theta / pi_b. What must hold, from the sampling distribution and
the formulas: the weighted group mean estimates the reward's expectation under the *trained* policy
(not the sampler's); weights of 1 are plain GRPO exactly; the token-mean loss is the weighted mean
over each mini-batch; the gradient is w A grad log pi_theta except where PPO's trust region against
the sampler holds a token back; and the config refuses it where it has no meaning.
tests/test_trajectory_parity.py runs it in `rl train` against bench/delayed_grpo.py's loop.
"""

from __future__ import annotations

import pytest
import torch

from engine.algorithms.advantages import grpo_advantages
from engine.algorithms.policy_loss import snis_token_loss
from engine.algorithms.snis import effective_sample_size, group_weights, loss_weights
from engine.config.resolved import resolve_run
from engine.config.schema import RunConfig
from tests.cli_utils import rl


def test_the_weighted_baseline_estimates_the_trained_policys_expected_reward():
    """Draw from pi_b, weight by pi_theta / pi_b: the weighted mean is E_{pi_theta}[r], and far from
    E_{pi_b}[r]. A ratio taken the wrong way round (pi_b / pi_theta) would land on the other side."""
    gen = torch.Generator().manual_seed(0)
    n = 40000
    logits_b, logits_theta = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, -1.0])
    reward = torch.tensor([1.0, 0.5, 0.0])
    y = torch.multinomial(torch.softmax(logits_b, 0), n, replacement=True, generator=gen)
    # each "response" is one token: its sequence log-prob is that token's
    lp_b = torch.log_softmax(logits_b, 0)[y][:, None]
    lp_theta = torch.log_softmax(logits_theta, 0)[y][:, None]
    w = group_weights(lp_theta, lp_b, torch.ones(n, 1), torch.ones(n, dtype=torch.bool), group_size=n)
    assert w.sum().item() == pytest.approx(n, rel=1e-5)
    estimate = (w * reward[y]).sum().item() / n
    want = float((torch.softmax(logits_theta, 0) * reward).sum())  # 0.7119
    under_b = float((torch.softmax(logits_b, 0) * reward).sum())   # 0.5
    assert estimate == pytest.approx(want, abs=0.01) and abs(estimate - under_b) > 0.15


def test_weights_normalise_within_each_group_and_fresh_rows_weigh_one():
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    roll = torch.zeros(4, 3)
    train = torch.tensor([[0.5, 0.5, 9.0], [0.0, 0.0, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    w = group_weights(train, roll, mask, torch.ones(4, dtype=torch.bool), group_size=2)
    # group 1: log w = (1.0, 0.0) (the padded 9.0 does not count); group 2: (0.2, 0.0)
    e = torch.tensor([1.0, 0.0]).exp()
    assert torch.allclose(w[:2], 2 * e / e.sum()) and w[:2].sum() == pytest.approx(2.0)
    e2 = torch.tensor([0.2, 0.0]).exp()
    assert torch.allclose(w[2:], 2 * e2 / e2.sum())
    fresh = group_weights(train, roll, mask, torch.zeros(4, dtype=torch.bool), group_size=2)
    assert torch.equal(fresh, torch.ones(4)), "rows the trained weights sampled are plain GRPO"
    ess = effective_sample_size(w, 2)
    assert ess[0] < ess[1] < 1.0 and effective_sample_size(torch.ones(4), 2).tolist() == [1.0, 1.0]


def test_weighted_advantages_by_hand_and_unit_weights_are_grpo():
    r = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.1, 0.4])
    assert torch.allclose(grpo_advantages(r, 3, weights=torch.ones(6)), grpo_advantages(r, 3), atol=1e-6)
    a = grpo_advantages(torch.tensor([1.0, 0.0]), 2, weights=torch.tensor([1.5, 0.5]))
    mean = 0.75  # (1.5 * 1 + 0.5 * 0) / 2
    std = ((1.5 * 0.25 ** 2 + 0.5 * 0.75 ** 2) / 1) ** 0.5
    assert torch.allclose(a, torch.tensor([0.25, -0.75]) / (std + 1e-6))
    dr = grpo_advantages(torch.tensor([1.0, 0.0]), 2, norm_by_std=False, weights=torch.tensor([1.5, 0.5]))
    assert torch.allclose(dr, torch.tensor([0.25, -0.75]))


def test_token_mean_loss_weights_give_the_weighted_mean_per_mini_batch():
    """token-mean divides by the mini-batch's token count N; the scaled weights make the aggregate
    sum_i w_i sum_t l_it / sum_i w_i |y_i| within each mini-batch (two mini-batches of two rows)."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = torch.tensor([1.6, 0.4, 1.0, 1.0])
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [1.0, 1.0, 0.0], [2.0, 2.0, 0.0]])
    lw = loss_weights(w, mask, rows_per_mini_batch=2, agg_mode="token-mean")
    for rows in (slice(0, 2), slice(2, 4)):
        n_tokens = mask[rows].sum()
        got = (lw[rows] * per_token[rows]).sum() / n_tokens
        want = (w[rows, None] * per_token[rows] * mask[rows]).sum() / (w[rows] * mask[rows].sum(-1)).sum()
        assert got.item() == pytest.approx(want.item())
    seq = loss_weights(w, mask, rows_per_mini_batch=2, agg_mode="seq-mean-token-mean")
    assert torch.equal(seq, w[:, None] * mask), "the seq-mean modes divide by the response count the weights sum to"


def test_gradient_is_weight_times_advantage_times_grad_log_p_inside_the_trust_region():
    """d loss / d log p = -w A where the token may still move, 0 where its ratio to the sampler is past
    the bound in its advantage's direction (PPO-clip's zero-gradient region), bounds per version."""
    log_p = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]])).requires_grad_(True)
    # ratios to the sampler: 2.0 (past 1.2^2 = 1.44), 1.0, 0.25 (under 0.8^2 = 0.64), 1.3
    roll = torch.log(torch.tensor([[0.25, 0.5, 2.0, 0.5 / 1.3]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    weight = torch.tensor([[0.7, 0.7, 0.7, 0.7]])
    behind = torch.ones(1, 4)  # one version behind: bounds 0.64 .. 1.44
    loss, held = snis_token_loss(log_p, roll, adv, weight, 0.2, 0.2, behind)
    loss.sum().backward()
    assert held.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert torch.allclose(log_p.grad, torch.tensor([[0.0, -0.7, 0.0, -0.7]]))
    # the same token at staleness 0 (bounds 0.8 .. 1.2): 1.3 is now past the upper bound
    _, held0 = snis_token_loss(log_p.detach(), roll, adv, weight, 0.2, 0.2, torch.zeros(1, 4))
    assert held0.tolist() == [[1.0, 0.0, 1.0, 1.0]]
    # a token past the bound *against* its advantage's direction keeps its gradient (it may come back)
    _, held_neg = snis_token_loss(log_p.detach(), roll, -adv, weight, 0.2, 0.2, behind)
    assert held_neg.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_snis_resolves_only_when_samples_may_be_stale():
    cfg = RunConfig()
    cfg.algorithm.off_policy_ratio = "snis"
    assert not resolve_run(cfg).snis, "sync mode: every sample is the trained weights' own"
    cfg.trainer.mode = "one_step_off"
    run = resolve_run(cfg)
    assert run.snis and not run.behavior_ratio and run.rollout_is == "off"


@pytest.mark.parametrize("override,said", [("algorithm.name=rloo", "has no group baseline"),
                                           ("algorithm.loss=gspo", "its own sequence ratio"),
                                           ("algorithm.rollout_is=token", "would correct twice")])
def test_snis_where_it_has_no_meaning_is_refused(override, said):
    r = rl("train", "trainer.mode=one_step_off", "algorithm.off_policy_ratio=snis", override,
           "checkpoint.dir=/nonexistent/x", timeout=60)
    text = " ".join(r.stderr.replace("│", " ").split())
    assert r.returncode == 2 and said in text, r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr
