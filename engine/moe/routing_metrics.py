"""How far the trainer's routing and log-probs are from the rollout's (algorithm.router_replay).

Ranks return partial sums (``RoutingSums``); the driver adds them and ``summarize`` turns them
into the per-step metrics (logged as ``train/<name>``):

routing_mismatch        share of recorded tokens whose trainer top-k expert set differs from
                        the rollout's in at least one routed layer (the trainer's own choice)
routing_mismatch_layer  the same per (token, layer) pair
logp_gap_no_replay      mean |log p_train - log p_rollout| over response tokens, trainer routing
                        by its own routers
logp_gap_replay         the same with the rollout's routing replayed
kl_no_replay / kl_replay  approx KL(rollout || train) on the sampled tokens (Schulman's k3:
                        mean of r - 1 - log r, r = p_train / p_rollout), without / with replay
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from engine.moe.routing_records import has_record


@dataclass
class RoutingSums:
    tokens: float = 0.0            # recorded tokens compared
    tokens_differ: float = 0.0
    pairs: float = 0.0             # recorded (token, layer) pairs compared
    pairs_differ: float = 0.0
    response_tokens: float = 0.0
    abs_gap_no_replay: float = 0.0
    k3_no_replay: float = 0.0
    abs_gap_replay: float = 0.0
    k3_replay: float = 0.0

    def add(self, other: "RoutingSums") -> "RoutingSums":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def routing_differs(own: torch.Tensor, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """own, records [N, L, k] -> (differs [N, L] bool, recorded [N, L] bool): whether the two
    top-k expert sets differ (order within the top-k does not count), and where a record exists."""
    recorded = has_record(records)
    same = own.long().sort(-1).values == records.long().sort(-1).values
    return ~same.all(-1) & recorded, recorded


def add_routing(sums: RoutingSums, own: torch.Tensor, records: torch.Tensor) -> None:
    differs, recorded = routing_differs(own, records)
    tok = recorded.all(-1)
    sums.tokens += float(tok.sum())
    sums.tokens_differ += float((differs.any(-1) & tok).sum())
    sums.pairs += float(recorded.sum())
    sums.pairs_differ += float(differs.sum())


def gap_sums(lp_train: torch.Tensor, lp_rollout: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(tokens, sum |Δ log p|, sum k3) over ``mask`` (response tokens)."""
    m = mask > 0
    d = (lp_train - lp_rollout)[m].double()   # log r, r = p_train / p_rollout
    return float(m.sum()), float(d.abs().sum()), float((d.exp() - 1 - d).sum())


def summarize(s: RoutingSums) -> dict:
    """The step's routing metrics from summed ``RoutingSums`` fields."""
    out = {}
    if s.tokens:
        out["routing_mismatch"] = s.tokens_differ / s.tokens
    if s.pairs:
        out["routing_mismatch_layer"] = s.pairs_differ / s.pairs
    if s.response_tokens:
        n = s.response_tokens
        out.update(logp_gap_no_replay=s.abs_gap_no_replay / n, kl_no_replay=s.k3_no_replay / n,
                   logp_gap_replay=s.abs_gap_replay / n, kl_replay=s.k3_replay / n)
    return out
