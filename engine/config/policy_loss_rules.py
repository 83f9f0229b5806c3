"""What ``algorithm.loss`` accepts beside it (engine/algorithms/policy_loss.py, docs/algorithms.md).

GSPO gives each response one loss term (its clipped sequence ratio times its advantage), so the
loss aggregation decides only how responses weigh against each other:
``seq-mean-token-mean`` (each response the same: the paper's objective) or ``token-mean`` (each
response by its length). ``seq-mean-token-sum`` multiplies a response's one term by its length
over a constant, so the loss is no longer an average over responses and its scale grows with
the response length (the length normalisation in the sequence ratio is undone): refused.
"""

from __future__ import annotations

from dataclasses import fields

from engine.config.schema import AlgorithmConfig
from engine.errors import ConfigError

GSPO_AGG_MODES = ("seq-mean-token-mean", "token-mean")
_GSPO_KEYS = ("gspo_clip_ratio_low", "gspo_clip_ratio_high")


def _default(name: str) -> float:
    return next(f.default for f in fields(AlgorithmConfig) if f.name == name)


def check_policy_loss(a: AlgorithmConfig) -> None:
    """Refuse (ConfigError, exit 2) what ``algorithm.loss`` cannot use or would ignore."""
    if a.kl_coef > 0 and a.use_kl_loss and a.kl_type == "k1":
        raise ConfigError(
            "`algorithm.kl_type=k1` as a loss (`algorithm.use_kl_loss=true`) does not pull the policy towards the "
            "reference: k1 = log pi - log ref on tokens sampled from pi has gradient grad log pi, whose expectation "
            "is 0, so the term adds noise and no regularisation. Use `algorithm.kl_type=k2` (its gradient is that "
            "of KL(pi || ref)) or `low_var_kl` (verl's default), or keep k1 in the reward with "
            "`algorithm.use_kl_loss=false`.", title="invalid config")
    if a.loss == "gspo":
        if a.loss_agg_mode not in GSPO_AGG_MODES:
            preset = (f" (`algorithm={a.name}` sets it)" if a.name in ("rloo", "dr_grpo") else "")
            raise ConfigError(
                f"`algorithm.loss=gspo` cannot use `algorithm.loss_agg_mode={a.loss_agg_mode}`{preset}: GSPO gives "
                f"each response one term, and a token sum would multiply it by the response's length, so the loss "
                f"would no longer be an average over responses. Set `algorithm.loss_agg_mode=seq-mean-token-mean` "
                f"(every response weighs the same: the paper's) or `token-mean` (responses weigh by length).",
                title="invalid config")
        if a.clip_ratio_c:
            raise ConfigError("`algorithm.clip_ratio_c` (dual-clip) caps the token-level PPO-clip loss; "
                              "`algorithm.loss=gspo` clips one sequence ratio per response instead. Drop "
                              "algorithm.clip_ratio_c, or use `algorithm.loss=ppo_clip`.", title="override has no effect")
        if a.gspo_clip_ratio_low >= 1.0:
            raise ConfigError("`algorithm.gspo_clip_ratio_low` must be < 1 (the lower clip bound of the sequence "
                              "ratio is 1 - gspo_clip_ratio_low; the paper uses 3e-4).", title="invalid config value")
        return
    if 0 < a.clip_ratio_c <= 1.0:
        raise ConfigError(f"`algorithm.clip_ratio_c={a.clip_ratio_c}` must be above 1: dual-clip caps a negative-"
                          f"advantage token's loss at c x |A|, and at c <= 1 it would cap tokens whose ratio has not "
                          f"moved at all. verl's default is 3; 0 turns it off.", title="invalid config value")
    changed = [k for k in _GSPO_KEYS if getattr(a, k) != _default(k)]
    if changed:
        raise ConfigError(
            f"`algorithm.{changed[0]}` is read only by `algorithm.loss=gspo`; this run uses "
            f"`algorithm.loss={a.loss}`, whose clip range is algorithm.clip_ratio_low/high. Set "
            f"`algorithm.loss=gspo`, or drop the gspo_* key.", title="override has no effect")
