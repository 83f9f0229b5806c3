"""GRPO advantages and the PPO-clip loss against hand-computed values."""

import math

import torch

from engine.algorithms.advantages import grpo_advantages
from engine.algorithms.policy_loss import aggregate, kl_penalty, ppo_clip_token_loss


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


def test_aggregation_modes_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, m, "token-mean", 4, 2).item() == 10 / 4
    assert aggregate(v, m, "seq-mean-token-mean", 4, 2).item() == (2 + 4) / 2
    assert aggregate(v, m, "seq-mean-token-sum", 4, 2).item() == (6 + 4) / 2


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_penalty(lp, ref, "k1").item() == 1.0
    assert abs(kl_penalty(lp, ref, "k3").item() - (math.exp(-1) + 1 - 1)) < 1e-6
