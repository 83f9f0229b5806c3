"""The batch scorers a run's config asks for, beside its reward functions: the reward model
(``task.reward_model.path``) and the remote scorer (``task.reward_url``)."""

from __future__ import annotations

from typing import Callable, Optional

from engine.rewards.remote import RemoteScorer
from engine.rewards.scorers import as_policy_saw


def scorers_for(cfg, tokenizer, make_actor: Optional[Callable] = None) -> tuple:
    """``cfg`` is the run's RunConfig, ``tokenizer`` the policy's (the remote scorer's ``query``
    is the text the policy saw). ``make_actor(rm_cfg, timeout_s)`` builds the Ray-actor reward
    model for ``placement=actor``; without it (rl eval: one process) the model is colocated."""
    t = cfg.task
    out = []
    rm = t.reward_model
    if rm.path:
        if rm.placement == "actor" and make_actor is not None:
            out.append(make_actor(rm, cfg.trainer.ray_timeout_s))
        else:
            from engine.reward_model.colocated import ColocatedRewardModel

            out.append(ColocatedRewardModel(rm, cfg.trainer.device))
    if t.reward_url:
        out.append(RemoteScorer(t.reward_url, weight=t.reward_url_weight, timeout_s=t.reward_url_timeout_s,
                                retries=t.reward_url_retries, batch_size=t.reward_url_batch_size,
                                render=as_policy_saw(tokenizer)))
    return tuple(out)


def check_scorers(cfg) -> str:
    """Preflight of the scorers (nothing loaded): the reward model's directory, config, weights
    files and tokenizer; the remote scorer's URL answers TCP connections. ConfigError otherwise."""
    t = cfg.task
    parts = []
    if t.reward_model.path:
        from engine.reward_model.model import load_tokenizer, resolve_reward_model

        local = resolve_reward_model(t.reward_model.path, t.reward_model.label_index)
        load_tokenizer(local, t.reward_model.path)
        parts.append(f"reward model {local} ({t.reward_model.placement})")
    if t.reward_url:
        from engine.rewards.remote import check_reachable

        parts.append(f"{t.reward_url}: {check_reachable(t.reward_url, t.reward_url_timeout_s)}")
    return "; ".join(parts)
