"""Config-time checks for length-bucket padding: refuse what cannot work, before a run starts.

Rules (each ConfigError names the keys and the fix):

1. A non-default ``engine.pad_to_length_policy`` (geometric, learned) with
   ``engine.pad_to_length=false`` is refused: the policy would silently do nothing (the trap
   verl's flag falls into when remove-padding is off).
2. Token-budget mode (``engine.micro_batch_size=0``): ``engine.max_tokens_per_micro_batch``
   must hold at least one bucket, i.e. be >= ``required_alignment`` (the lcm of the bucket and
   the parallel/FP8 sizes). A bucket that is not a multiple of the parallel/FP8 alignment is
   NOT an error: it is rounded up to the lcm, and the docs say so.
3. When the longest sequence is known (``max_seq_length`` = data.max_prompt_length +
   rollout.max_new_tokens), with a token budget its padded length must fit the budget (both
   layouts), or the longest rollouts could never be trained on.
Warnings (returned, not raised): ``engine.compile=true`` without ``pad_to_length`` recompiles
for nearly every micro-batch; policy=learned with ``pad_to_length_max_shapes=1`` is a fixed
budget (its top boundary alone).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

from engine.batching.buckets import alignment_factors, make_bucket_policy, required_alignment, round_up
from engine.errors import ConfigError


def _default(cfg, name: str):
    for f in fields(cfg):
        if f.name == name:
            return f.default
    raise KeyError(name)


def _explain_alignment(engine_cfg) -> str:
    parts = [f"{k}={v}" for k, v in alignment_factors(engine_cfg).items() if v > 1]
    return f"{required_alignment(engine_cfg)} (lcm of {', '.join(parts)})" if parts else "1"


SINGLE_TURN_LENGTH = ("data.max_prompt_length + rollout.max_new_tokens", "data.max_prompt_length / rollout.max_new_tokens")
MULTI_TURN_LENGTH = ("data.max_prompt_length + the trajectory budget",
                     "data.max_prompt_length or the trajectory budget (rollout.max_trajectory_tokens; when 0, "
                     "rollout.max_turns x rollout.max_new_tokens)")


def validate_padding_config(engine_cfg, *, max_seq_length: Optional[int] = None,
                            layout: str = "padded", length_keys: tuple = SINGLE_TURN_LENGTH) -> list[str]:
    """Raise ConfigError for padding settings that cannot work; return warnings for poor ones.
    ``length_keys``: how ``max_seq_length`` is made, and what shortens it (for the message)."""
    warnings: list[str] = []
    policy_default = _default(engine_cfg, "pad_to_length_policy")
    if not engine_cfg.pad_to_length and engine_cfg.pad_to_length_policy != policy_default:
        raise ConfigError(
            f"engine.pad_to_length_policy={engine_cfg.pad_to_length_policy} has no effect because "
            f"engine.pad_to_length=false; set engine.pad_to_length=true to pad micro-batches to "
            f"{engine_cfg.pad_to_length_policy} buckets, or remove the policy override.", title="invalid config")
    if (engine_cfg.pad_to_length and engine_cfg.pad_to_length_policy == "learned"
            and engine_cfg.pad_to_length_max_shapes < 2):
        warnings.append("engine.pad_to_length_max_shapes=1 leaves policy=learned only its top "
                        "boundary: every micro-batch pads to the longest length (a fixed budget).")

    align = required_alignment(engine_cfg)
    budget = engine_cfg.max_tokens_per_micro_batch
    # budget 0: fitted to the device when the ranks start (engine/memory/micro_batch_fit.py)
    budget_mode = engine_cfg.micro_batch_size == 0 and budget > 0
    if budget_mode and budget < align:
        raise ConfigError(
            f"engine.max_tokens_per_micro_batch={budget} is smaller than one bucket: every padded "
            f"length is a multiple of {_explain_alignment(engine_cfg)}; raise "
            f"engine.max_tokens_per_micro_batch to at least {align}, or lower "
            f"engine.pad_to_length_bucket.", title="invalid config")
    if budget_mode and max_seq_length is not None:
        policy = make_bucket_policy(engine_cfg, max_length=max_seq_length if layout == "padded" else None)
        longest = (policy.bucket_length(max_seq_length) if max_seq_length <= policy.max_length
                   else round_up(max_seq_length, align))
        if longest > budget:
            raise ConfigError(
                f"the longest sequence ({length_keys[0]} = "
                f"{max_seq_length} tokens) pads to {longest}, more than "
                f"engine.max_tokens_per_micro_batch={budget}; raise "
                f"engine.max_tokens_per_micro_batch to at least {longest} or shorten "
                f"{length_keys[1]}.", title="sequence too long")
    if getattr(engine_cfg, "compile", False) and not engine_cfg.pad_to_length:
        warnings.append("engine.compile=true without engine.pad_to_length: nearly every micro-batch "
                        "has a new shape and recompiles; set engine.pad_to_length=true.")
    return warnings


def validate_run_padding(run_cfg, layout: str = "padded", longest: int | None = None,
                         length_keys: tuple = SINGLE_TURN_LENGTH) -> list[str]:
    """``validate_padding_config`` for a whole RunConfig. ``longest``: the longest row
    (engine/config/lengths.py, multi-turn trajectories included; ``length_keys`` then
    MULTI_TURN_LENGTH); default the single-turn one."""
    max_seq = longest if longest is not None else (int(run_cfg.data.max_prompt_length)
                                                   + int(run_cfg.rollout.max_new_tokens))
    return validate_padding_config(run_cfg.engine, max_seq_length=max_seq, layout=layout, length_keys=length_keys)
