"""What sampling ahead of the update (trainer.mode=one_step_off|async) cannot be combined with,
each refused with the reason and the fix (docs/async.md)."""

from __future__ import annotations

from engine.config.resolved import versions_ahead
from engine.config.schema import RunConfig
from engine.errors import ConfigError


def check_rollout_ahead(cfg: RunConfig) -> None:
    mode = f"trainer.mode={cfg.trainer.mode}"
    if cfg.algorithm.router_replay != "off":
        raise ConfigError(
            f"`{mode}` with `algorithm.router_replay={cfg.algorithm.router_replay}` is not supported: the rollout "
            f"worker that samples ahead does not record each token's experts. Use trainer.mode=sync, or set "
            f"algorithm.router_replay=off.", title="invalid config")
    a = cfg.algorithm
    if a.off_policy_ratio == "behavior" and a.rollout_is in ("token", "sequence") and versions_ahead(cfg):
        raise ConfigError(
            f"`algorithm.rollout_is={a.rollout_is}` with `algorithm.off_policy_ratio=behavior` (the default) does "
            f"nothing under `{mode}`: PPO's ratio is then already against the sampler's log-probs, so the weight "
            f"pi_old / pi_rollout is 1. Set algorithm.off_policy_ratio=proximal for decoupled PPO with the truncated "
            f"weight, or drop algorithm.rollout_is.", title="invalid config")
