"""GRPO advantages and the PPO-clip loss against hand-computed values."""

import math

import pytest
import torch

from engine.algorithms.advantages import grpo_advantages
from engine.algorithms.policy_loss import aggregate, dual_clip, kl_penalty, ppo_clip_token_loss


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    a = grpo_advantages(r, group_size=4)
    # group 1: mean .5, unbiased std sqrt(1/3); group 2: all equal -> 0
    s = math.sqrt(1 / 3)
    expected = torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0])
    assert torch.allclose(a, expected, atol=1e-5)
    dr = grpo_advantages(r, group_size=4, norm_by_std=False)
    assert torch.allclose(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_ppo_clip_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios vs old=log(1): 1.5, 0.5, 1.1
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, clipped = ppo_clip_token_loss(logp, old, adv, 0.2, 0.28)
    # token 1: A>0, r=1.5 -> clipped to 1.28 -> -1.28; token 2: A<0, r=.5 -> clip .8 -> max(.5, .8)=.8
    # token 3: r=1.1 within range -> -2.2
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -2.2]]), atol=1e-6)
    assert clipped.tolist() == [[1.0, 1.0, 0.0]]


def test_dual_clip_by_hand():
    """Dual-clip caps a negative-advantage token's PPO loss at c |A|: beyond ratio c it adds no
    gradient; below c, and for every positive advantage, the PPO-clip loss is unchanged."""
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.5]])
    logp = torch.log(ratios).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 2.0, -2.0]])
    loss, _ = ppo_clip_token_loss(logp, torch.zeros(1, 4), adv, 0.2, 0.28)
    capped_loss, capped = dual_clip(loss, adv, 3.0)
    # A<0, r=5 > 3: PPO's max(-A r, -A clip(r)) = 5, capped at 3; A<0, r=2: 2; A>0, r=5: -2 * 1.28;
    # A<0, r=.5: max(.5 * 2, .8 * 2) = 1.6
    assert torch.allclose(capped_loss, torch.tensor([[3.0, 2.0, -2.56, 1.6]]), atol=1e-6)
    assert capped.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    capped_loss.sum().backward()
    # d(-A r)/d log p = -A r: the capped token none, the token at r=2 its full 2
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]]), atol=1e-6)


def test_aggregation_modes_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, m, "token-mean", 4, 2).item() == 10 / 4
    assert aggregate(v, m, "seq-mean-token-mean", 4, 2).item() == (2 + 4) / 2
    assert aggregate(v, m, "seq-mean-token-sum", 4, 2).item() == (6 + 4) / 2


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_penalty(lp, ref, "k1").item() == 1.0
    assert kl_penalty(lp, ref, "k2").item() == 0.5
    assert abs(kl_penalty(lp, ref, "k3").item() - (math.exp(-1) + 1 - 1)) < 1e-6


def _exact_expected_grad(kind: str, logits: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi}[grad kl_kind(a)] exactly (a sum over the vocabulary), as an on-policy loss term
    differentiates it: the sample's probability is not differentiated (the loss sees fixed tokens)."""
    theta = logits.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    probs = logp.exp().detach()
    (probs * kl_penalty(logp, ref_logp, kind)).sum().backward()
    return theta.grad


def test_kl_estimators_expected_gradients_from_first_principles():
    """As a loss on tokens sampled from pi: k2's expected gradient is exactly grad KL(pi || ref);
    k1's is 0 (why config refuses k1 as a loss); k3's is grad KL(ref || pi) (the known caveat)."""
    g = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(6, generator=g), torch.randn(6, generator=g)
    ref_logp = torch.log_softmax(ref_logits, -1)

    def true_grad(reverse: bool) -> torch.Tensor:
        theta = logits.clone().requires_grad_()
        logp = torch.log_softmax(theta, -1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum() if reverse else (logp.exp() * (logp - ref_logp)).sum()
        kl.backward()
        return theta.grad

    assert torch.allclose(_exact_expected_grad("k2", logits, ref_logp), true_grad(False), atol=1e-6)
    assert torch.allclose(_exact_expected_grad("k1", logits, ref_logp), torch.zeros(6), atol=1e-6)
    assert torch.allclose(_exact_expected_grad("k3", logits, ref_logp), true_grad(True), atol=1e-6)
    assert not torch.allclose(true_grad(True), true_grad(False), atol=1e-3)  # the two differ here


def test_kl_and_ratio_stay_finite_where_a_log_prob_is_far_below_the_reference():
    """A padded position: the reference's log-prob is 0 there, the policy's may be below -88; the
    term is masked afterwards, but an infinite exp would make its gradient 0 x inf = NaN and the
    whole step's gradient non-finite."""
    log_p = torch.tensor([[-1.0, -95.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        (kl_penalty(log_p, torch.tensor([[-1.5, 0.0]]), kind) * mask).sum().backward()
        assert torch.isfinite(log_p.grad).all(), kind
        log_p.grad = None
    loss, _ = ppo_clip_token_loss(log_p, torch.tensor([[-1.0, -200.0]]), torch.tensor([[1.0, 0.0]]), 0.2, 0.28)
    (loss * mask).sum().backward()
    assert torch.isfinite(log_p.grad).all()


# ---- estimators (engine/algorithms/estimators.py) ---------------------------------------

from engine.algorithms.dynamic_sampling import Rollout, dynamic_sample  # noqa: E402
from engine.algorithms.estimators import (  # noqa: E402
    compute_advantages, discounted_returns, gae, outcome_token_rewards, overlong_penalty,
    reinforce_pp_advantages, rloo_advantages, whiten, zero_variance_groups)
from engine.batch import SequenceBatch  # noqa: E402
from engine.config.schema import AlgorithmConfig  # noqa: E402


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    a = rloo_advantages(r, group_size=4)
    # sample 0: 1 - (0+0+1)/3 = 2/3; sample 1: 0 - (1+0+1)/3 = -2/3; equal group -> 0
    assert torch.allclose(a, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]), atol=1e-6)
    assert torch.equal(rloo_advantages(torch.tensor([5.0, 1.0]), 1), torch.zeros(2))


# two rows: prompt of 2 tokens then a response of 3 (row 0) / 2 (row 1) tokens, T = 5
MASK = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.float32)


def test_outcome_reward_sits_on_the_last_response_token():
    tok = outcome_token_rewards(torch.tensor([1.0, 2.0]), MASK)
    assert tok.tolist() == [[0, 0, 0, 0, 1.0], [0, 0, 0, 2.0, 0]]


def test_discounted_returns_by_hand():
    tok = torch.tensor([[0, 0, 1.0, 0, 2.0], [0, 0, 0, 4.0, 0]])
    g = discounted_returns(tok, MASK, gamma=0.5)
    # row 0: G4 = 2, G3 = 0 + .5*2 = 1, G2 = 1 + .5*1 = 1.5; row 1: G3 = 4, G2 = 2
    assert torch.allclose(g, torch.tensor([[0, 0, 1.5, 1.0, 2.0], [0, 0, 2.0, 4.0, 0]]))


def test_whiten_over_masked_tokens_only():
    x = torch.tensor([[9.0, 9.0, 1.0, 2.0, 3.0], [9.0, 9.0, 4.0, 5.0, 9.0]])
    w = whiten(x, MASK)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, unbiased std sqrt(2.5)
    exp = (vals - 3) / math.sqrt(2.5)
    assert torch.allclose(w[MASK > 0], exp, atol=1e-5)
    assert (w[MASK == 0] == 0).all()


def test_reinforce_pp_kl_enters_the_reward_then_batch_normalised():
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0, 0, 1.0, 1.0, 1.0], [0, 0, 2.0, 2.0, 0]])
    a = reinforce_pp_advantages(rewards, MASK, kl, kl_coef=0.1, gamma=1.0)
    # token rewards: row 0 [-.1, -.1, .9], row 1 [-.2, -.2]; returns (gamma 1):
    # row 0 [.7, .8, .9], row 1 [-.4, -.2]; then whitened over these 5 tokens
    g = torch.tensor([0.7, 0.8, 0.9, -0.4, -0.2])
    exp = (g - g.mean()) / g.std()
    assert torch.allclose(a[MASK > 0], exp, atol=1e-5)
    # no KL: global normalisation still spreads the two outcomes apart (no per-prompt baseline)
    b = reinforce_pp_advantages(rewards, MASK)
    assert (b[0, 2:] > 0).all() and (b[1, 2:4] < 0).all()


def test_gae_by_hand():
    tok = torch.tensor([[0, 0, 0, 0, 1.0], [0, 0, 0, 1.0, 0]])
    values = torch.tensor([[7.0, 7.0, 0.5, 0.5, 0.5], [7.0, 7.0, 0.2, 0.4, 7.0]])
    adv, ret = gae(tok, values, MASK, gamma=1.0, lam=0.5)
    # row 0: d4 = 1 - .5 = .5; d3 = 0 + .5 - .5 = 0; d2 = 0
    #   A4 = .5, A3 = 0 + .5*.5 = .25, A2 = 0 + .5*.25 = .125
    # row 1: d3 = 1 - .4 = .6, d2 = .4 - .2 = .2; A3 = .6, A2 = .2 + .5*.6 = .5
    assert torch.allclose(adv, torch.tensor([[0, 0, .125, .25, .5], [0, 0, .5, .6, 0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0, 0, .625, .75, 1.0], [0, 0, .7, 1.0, 0]]), atol=1e-6)
    # lam = 1, gamma = 1: advantage = final reward - V_t (Monte-Carlo)
    adv1, _ = gae(tok, values, MASK, 1.0, 1.0)
    assert torch.allclose(adv1[0, 2:], torch.tensor([0.5, 0.5, 0.5]))


def test_overlong_penalty_soft_window():
    lengths = torch.tensor([4, 8, 9, 10, 12, 13])
    p = overlong_penalty(lengths, max_len=12, buffer_len=4, factor=1.0)
    # free up to 12 - 4 = 8, then a linear ramp to -1 at 12, and -1 beyond
    assert torch.allclose(p, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    assert torch.equal(overlong_penalty(lengths, 12, 0), torch.zeros(6))


def test_groups_whose_rewards_are_all_equal_get_exactly_zero_advantage():
    """No reward difference, no push: a float32 mean one ulp off a fractional reward, divided by a
    std of ~6e-8, gave every sample of such a group the same advantage of ~0.06."""
    for n in (2, 3, 5, 7, 8, 16, 64):
        for value in (0.1, 0.3, 0.7, 0.9, 1 / 3, 0.55):
            r = torch.cat([torch.full((n,), value), torch.arange(n, dtype=torch.float32) / n])
            for adv in (grpo_advantages(r, n), grpo_advantages(r, n, norm_by_std=False), rloo_advantages(r, n)):
                assert torch.equal(adv[:n], torch.zeros(n)), (n, value)
                assert adv[n:].abs().sum() > 0  # the group with a spread still learns


def test_multi_turn_returns_and_gae_skip_the_environment_tokens():
    """Two model turns with a tool's tokens between them (mask 0), outcome reward 1 on the last
    model token: every model token of both turns earns it (the episode ends once, at the last
    token), and GAE bootstraps turn 1's last token from turn 2's first value, not from 0."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    tok = outcome_token_rewards(torch.tensor([1.0]), mask)
    assert torch.equal(discounted_returns(tok, mask, 1.0), mask)
    # gamma counts model tokens only: 4 of them, the first 3 steps from the reward
    g = discounted_returns(tok, mask, 0.5)
    assert torch.allclose(g, torch.tensor([[0, 0.125, 0.25, 0, 0, 0.5, 1.0, 0]]))
    values = torch.full((1, 8), 0.5)
    adv, ret = gae(tok, values, mask, 1.0, 1.0)
    assert torch.allclose(adv, 0.5 * mask)   # Monte-Carlo: 1 - V on every model token
    assert torch.allclose(ret, mask)          # the critic's target: the outcome, in both turns
    # lam = 0 (one-step TD): turn 1's last token sees turn 2's first value
    adv0, _ = gae(tok, torch.tensor([[0, 0.1, 0.2, 9, 9, 0.3, 0.4, 9]]), mask, 1.0, 0.0)
    assert torch.allclose(adv0, torch.tensor([[0, 0.1, 0.1, 0, 0, 0.1, 0.6, 0]]), atol=1e-6)


def test_overlong_penalty_reads_the_longest_model_turn():
    """Each turn is sampled under max_new_tokens on its own: two turns of 6 tokens under a limit
    of 12 (buffer 4) are not near it; a turn of 11 is."""
    from engine.algorithms.estimators import longest_turn

    mask = torch.tensor([[1] * 6 + [0] * 3 + [1] * 6, [1] * 11 + [0] * 2 + [1] * 2, [1] * 12 + [0] * 3],
                        dtype=torch.float32)
    assert longest_turn(mask).tolist() == [6, 11, 12]
    out = compute_advantages(AlgorithmConfig(name="dapo", overlong_buffer_len=4, rollout_n=3),
                             torch.ones(3), mask, 3, max_len=12)
    assert out.metrics["overlong_penalty"] == pytest.approx((0 - 0.75 - 1.0) / 3)


def test_zero_variance_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert zero_variance_groups(r, 2).tolist() == [True, False, True]


def test_compute_advantages_dispatches_each_preset():
    rewards = torch.tensor([1.0, 0.0])
    rloo = compute_advantages(AlgorithmConfig(name="rloo"), rewards, MASK, group_size=2)
    assert torch.allclose(rloo.advantages, torch.tensor([[0, 0, 1.0, 1, 1], [0, 0, -1, -1, 0]]))
    dr = compute_advantages(AlgorithmConfig(name="dr_grpo"), rewards, MASK, group_size=2)
    assert torch.allclose(dr.advantages, torch.tensor([[0, 0, .5, .5, .5], [0, 0, -.5, -.5, 0]]))
    values = torch.zeros(2, 5)
    ppo = compute_advantages(AlgorithmConfig(name="ppo", lam=1.0, whiten_advantages=False), rewards, MASK, 2,
                             values=values)
    assert torch.allclose(ppo.advantages, torch.tensor([[0, 0, 1.0, 1, 1], [0, 0, 0, 0, 0]]))
    assert torch.equal(ppo.returns, ppo.advantages)  # V = 0
    # KL goes into the reward only when use_kl_loss is false
    kl = torch.ones(2, 5)
    cfg = AlgorithmConfig(name="rloo", kl_coef=0.5, use_kl_loss=False)
    with_kl = compute_advantages(cfg, rewards, MASK, 2, kl=kl)
    # each token pays the KL of itself and every later token of its response (reward-to-go):
    # row 0 has 3 response tokens, row 1 two
    to_go = torch.tensor([[0, 0, 3.0, 2, 1], [0, 0, 2, 1, 0]])
    assert torch.allclose(with_kl.advantages, rloo.advantages - 0.5 * to_go)
    as_loss = compute_advantages(AlgorithmConfig(name="rloo", kl_coef=0.5), rewards, MASK, 2, kl=kl)
    assert torch.equal(as_loss.advantages, rloo.advantages)


def test_every_estimator_reports_the_share_of_groups_whose_samples_scored_the_same():
    """TRL's frac_reward_zero_std: groups of 2 with rewards (1, 1), (0, 1), (.5, .5) -> 2 of 3; the
    groups that give a group-relative estimator no signal, and the all-zero advantages behind the
    no_signal alarm when every group is one of them."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    mask = torch.ones(6, 3)
    for name in ("grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "ppo"):
        est = compute_advantages(AlgorithmConfig(name=name), rewards, mask, 2, values=torch.zeros(6, 3))
        assert est.metrics["frac_reward_zero_std"] == pytest.approx(2 / 3), name
    flat = compute_advantages(AlgorithmConfig(name="grpo"), torch.full((6,), 0.25), mask, 2)
    assert flat.metrics["frac_reward_zero_std"] == 1.0 and torch.count_nonzero(flat.advantages) == 0
    assert "frac_reward_zero_std" not in compute_advantages(AlgorithmConfig(name="reinforce_pp"), rewards, mask, 1).metrics


# ---- DAPO dynamic sampling --------------------------------------------------------------

def _fake_rollout(rewards: list[float], n: int) -> Rollout:
    """Rows of real SequenceBatch tensors; row i's first token id is i (to trace the rows)."""
    b = len(rewards)
    ids = torch.stack([torch.tensor([i, 1, 2]) for i in range(b)])
    batch = SequenceBatch(ids, torch.ones(b, 3, dtype=torch.long),
                          torch.tensor([[0, 1.0, 1.0]] * b), torch.ones(b, dtype=torch.long))
    return Rollout(batch, torch.tensor(rewards), [r > 0.5 for r in rewards], examples=list(range(b // n)))


def test_dynamic_sampling_drops_flat_groups_and_keeps_the_batch_size():
    n, target = 2, 3
    draws = iter([[1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 0, 1]])  # groups: flat, mixed, flat | mixed, flat, mixed
    asked = []

    def draw(k):
        asked.append(k)
        return _fake_rollout([float(x) for x in next(draws)][:k * n], n)

    out, stats = dynamic_sample(draw, target, n, max_rounds=4)
    assert len(out.rewards) == target * n and len(out.batch) == target * n
    assert out.rewards.tolist() == [0, 1, 1, 0, 0, 1]  # draw-1 group 1, then draw-2 groups 0 and 2
    assert zero_variance_groups(out.rewards, n).sum() == 0
    assert stats.rounds == 2 and stats.padded_groups == 0
    assert asked == [3, 3]  # 1 of 3 kept: 2 more needed at a keep rate of 1/3 -> 6, capped at the target
    assert out.correct == [False, True, True, False, False, True]


def test_dynamic_sampling_tops_up_when_out_of_rounds():
    n, target = 2, 4

    def draw(k):  # every group flat except the very first
        return _fake_rollout([1.0, 0.0] + [1.0] * (2 * k - 2), n)

    out, stats = dynamic_sample(draw, target, n, max_rounds=2)
    assert len(out.batch) == target * n  # constant batch size even when signal is scarce
    assert stats.rounds == 3 and stats.padded_groups == 3 - 2  # 3 rounds, each one good group -> 3 kept, 1 pad
    assert zero_variance_groups(out.rewards, n).tolist() == [False, False, False, True]


def test_entropy_metric_is_per_token_for_every_aggregation():
    """dr_grpo/rloo aggregate the loss per response (seq-mean-token-sum); the entropy they
    report must still be the per-token mean (the alarms compare it with per-token thresholds)."""
    from engine.algorithms.policy_loss import PolicyLoss

    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    b = SequenceBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), mask,
                      torch.ones(2, dtype=torch.long))
    b.advantages = torch.zeros(2, 4)
    ent = torch.full((2, 4), 0.5)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        _, m = PolicyLoss(AlgorithmConfig(loss_agg_mode=mode))(torch.zeros(2, 4), ent, b, 5.0, 2.0)
        assert m["entropy"] == pytest.approx(0.5), mode


def test_k1_as_a_loss_is_refused_and_k1_in_the_reward_is_not():
    """k1's expected gradient as a loss is 0 (test above): a run asking for it gets no pull towards
    the reference, so it is refused with the fix; k1 in the reward (reinforce_pp's preset) is the
    estimator's proper use."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kl_type=k1.*as a loss.*kl_type=k2"):
        load_run_config(["algorithm.kl_coef=0.1", "algorithm.kl_type=k1"])
    assert load_run_config(["algorithm=reinforce_pp"]).config.algorithm.kl_type == "k1"
    load_run_config(["algorithm.kl_coef=0.1", "algorithm.kl_type=k2"])
    load_run_config(["algorithm.kl_type=k1"])  # no reference (kl_coef 0): the estimator is never used
