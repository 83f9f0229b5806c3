"""One naming scheme for every logger and for `rl plot`: ``train/``, ``val/``, ``perf/``, ``mem/``.

``step_metrics(row)`` turns one metrics.jsonl row (``StepRecord.to_json()``) into
``{"train/reward": ..., "perf/time/rollout": ...}``. The same function reads old rows back
(fields added later are simply absent), so `rl plot --metric train/reward` works on any run.
"""

from __future__ import annotations

import math

# metric name -> metrics.jsonl field
STEP_FIELDS: dict[str, str] = {
    "train/reward": "reward_mean",
    "train/accuracy": "accuracy",
    "train/kl": "kl",
    "train/pg_loss": "pg_loss",
    "train/entropy": "entropy",
    "train/clip_frac": "clip_frac",
    "train/rollout_kl": "rollout_kl",
    "train/grad_norm": "grad_norm",
    "train/lr": "lr",
    "train/advantage_mean": "adv_mean",
    "train/advantage_std": "adv_std",
    "train/advantage_min": "adv_min",
    "train/advantage_max": "adv_max",
    "train/response_len_mean": "response_len_mean",
    "train/response_len_min": "response_len_min",
    "train/response_len_max": "response_len_max",
    "train/response_clip_frac": "response_clip_frac",
    "perf/step_time_s": "step_time_s",
    "perf/rollout_tokens_per_s": "rollout_tokens_per_s",
    "perf/update_tokens_per_s": "update_tokens_per_s",
    "perf/samples_per_s": "samples_per_s",
    "perf/pad_fraction": "pad_fraction",
    "perf/distinct_shapes": "distinct_shapes",
    "mem/peak_bytes": "peak_mem_bytes",
}
# val/ metrics are logged from Validation events (validation.jsonl), not from the step rows
# nested dicts in a row: prefix -> field
STEP_DICTS: dict[str, str] = {"perf/time/": "timing", "mem/": "mem_peaks", "train/": "algo",
                              "train/reward/": "reward_fns", "async/": "staleness"}  # each reward source (function, reward model, URL)
# short names people type: `rl plot --metric reward`
ALIASES: dict[str, str] = {"reward": "train/reward", "accuracy": "train/accuracy", "val": "val/reward",
                           "reward_mean": "train/reward"}


def _number(v) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        try:
            f = float(v)
        except OverflowError:  # an int beyond any float (10**400 in a damaged row): not a finite number
            return None
        return f if math.isfinite(f) else None
    return None


def step_metrics(row: dict) -> dict[str, float]:
    """Every number a metrics.jsonl row holds, under its logged name (absent/None values left out)."""
    out: dict[str, float] = {}
    for name, key in STEP_FIELDS.items():
        v = _number(row.get(key))
        if v is not None:
            out[name] = v
    for prefix, key in STEP_DICTS.items():
        nested = row.get(key)
        if not isinstance(nested, dict):  # absent, or a damaged/edited row ("timing": "x"): nothing to read
            continue
        for k, v in nested.items():
            v = _number(v)
            if v is not None:
                out[prefix + k] = v
    return out


def validation_metrics(accuracy: float | None, reward: float | None) -> dict[str, float]:
    """val/reward and val/accuracy, each left out when it is not a finite number (as in
    step_metrics: a validation.jsonl row with a null, a string or NaN there draws nothing)."""
    out = {}
    for name, v in (("val/reward", reward), ("val/accuracy", accuracy)):
        v = _number(v)
        if v is not None:
            out[name] = v
    return out


def resolve_metric(name: str) -> str:
    """A metric name as typed -> its logged name (aliases and raw metrics.jsonl fields accepted)."""
    if name in ALIASES:
        return ALIASES[name]
    for logged, key in STEP_FIELDS.items():
        if name == key:
            return logged
    return name
