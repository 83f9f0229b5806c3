"""How the driver turns every rank's answer to one policy update into one result: the
world-size rule for metrics, in one place (engine/interfaces.py states all of them).

Each rank returns ``{"metrics", "replicated", "tokens", "padded_tokens", "shapes", "rss_peak"}``
(engine/trainer/worker.py RankWorker.train_step). Ranks of one data-parallel group (megatron's
tensor-parallel ranks) saw the same rows, so partial sums and token counts are taken from one
rank per group and added (``*_min``/``*_max`` metrics: the extreme, engine/metric_sums.py);
replicated values (grad norm, LR) are the same everywhere: rank 0's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metric_sums import add_metrics


@dataclass
class UpdateResult:
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    padded_tokens: int = 0
    shapes: set = field(default_factory=set)
    rss_peak: int = 0


def combine_update(outs: list[dict], dp_leaders: list[int]) -> UpdateResult:
    """``outs``: per-rank results in rank order; ``dp_leaders``: one rank index per DP group."""
    res = UpdateResult()
    for i in dp_leaders:
        o = outs[i]
        add_metrics(res.metrics, o["metrics"])
        res.tokens += o["tokens"]
        res.padded_tokens += o["padded_tokens"]
    res.metrics.update(outs[0].get("replicated", {}))
    for o in outs:
        res.shapes.update(tuple(s) for s in o["shapes"])
        res.rss_peak = max(res.rss_peak, o["rss_peak"])
    return res
