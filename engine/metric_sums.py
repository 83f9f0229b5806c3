"""How an update's metrics combine over micro-batches, data-parallel ranks and optimizer steps.

A loss reports each metric as its share of a global aggregate (engine/interfaces.py), so shares
add up: over micro-batches (engine/backends/base.py), over data-parallel groups
(engine/trainer/rank_results.py) and over the optimizer steps of one RL step, whose sum the
trainer divides by the number of steps (engine/trainer/trainer.py). An extreme cannot be added:
a metric whose name ends in ``_min`` or ``_max`` (GSPO's ``seq_ratio_min``/``seq_ratio_max``)
combines by taking the smaller or larger value everywhere, and is not divided.
"""

from __future__ import annotations


def _rule(key: str):
    if key.endswith("_min"):
        return min
    if key.endswith("_max"):
        return max
    return None


def add_metric(acc: dict, key: str, value) -> None:
    """Fold ``value`` into ``acc[key]``: the minimum/maximum for ``*_min``/``*_max``, else the sum."""
    value = float(value)
    if key not in acc:
        acc[key] = value
        return
    rule = _rule(key)
    acc[key] = rule(acc[key], value) if rule is not None else acc[key] + value


def add_metrics(acc: dict, metrics: dict) -> dict:
    """Fold every entry of ``metrics`` into ``acc``; returns ``acc``."""
    for k, v in metrics.items():
        add_metric(acc, k, v)
    return acc


def mean_over_updates(totals: dict, n_updates: int) -> dict:
    """Per-optimizer-step values from the totals of ``n_updates`` steps: sums divided, extremes kept."""
    return {k: v if _rule(k) is not None else v / n_updates for k, v in totals.items()}
