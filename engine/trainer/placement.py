"""Where the ranks go: one Ray placement group for the run, checked against what the cluster
has before anything waits on it.

- ``trainer.nnodes=0`` (default): one bundle per rank ({CPU: 1, GPU: 1 on CUDA}), placed with
  ``trainer.placement`` (PACK: as few nodes as possible).
- ``trainer.nnodes=N``: exactly N nodes with ``ranks_per_node`` ranks each: one bundle per node
  sized for its ranks, STRICT_SPREAD (a placement group cannot pin "k per-rank bundles on each
  of N distinct nodes"); ranks 0..k-1 share node 0's bundle, and so on.

A request no set of nodes can hold (more GPUs than the cluster has, more nodes than are alive)
is refused at once, naming what the cluster has; a placeable one that stays pending (the
resources are busy) is refused after the wait, naming what is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UserError


@dataclass
class PlacementPlan:
    bundles: list[dict]
    strategy: str
    bundle_of_rank: list[int]
    rank_resources: dict


def plan_placement(nprocs: int, nnodes: int, ranks_per_node: int, strategy: str, gpus_per_rank: int) -> PlacementPlan:
    rank = {"CPU": 1.0} | ({"GPU": float(gpus_per_rank)} if gpus_per_rank else {})
    if nnodes:
        k = ranks_per_node or nprocs // nnodes
        node = {r: v * k for r, v in rank.items()}
        return PlacementPlan([dict(node) for _ in range(nnodes)], "STRICT_SPREAD" if nnodes > 1 else "STRICT_PACK",
                             [r // k for r in range(nprocs)], rank)
    return PlacementPlan([dict(rank) for _ in range(nprocs)], strategy, list(range(nprocs)), rank)


def _fits(bundle: dict, capacity: dict) -> int:
    """How many copies of ``bundle`` fit in ``capacity``."""
    n = None
    for r, v in bundle.items():
        if v > 0:
            c = int(capacity.get(r, 0.0) // v)
            n = c if n is None else min(n, c)
    return n if n is not None else 1 << 30


def unplaceable_reason(plan: PlacementPlan, node_capacity: list[dict]) -> str:
    """'' when some arrangement of ``plan`` fits the nodes' total resources, else why not.
    ``node_capacity``: one resource dict per alive node. Bundles of one plan are identical."""
    b, n = plan.bundles[0], len(plan.bundles)
    per_node = [_fits(b, cap) for cap in node_capacity]
    if plan.strategy == "STRICT_SPREAD":
        ok = sum(1 for k in per_node if k >= 1)
        if ok < n:
            return f"{n} distinct nodes each with {_res(b)} are needed; {ok} node(s) have that"
    elif plan.strategy == "STRICT_PACK":
        total = {r: v * n for r, v in b.items()}
        if not any(_fits(total, cap) >= 1 for cap in node_capacity):
            return f"one node with {_res(total)} is needed; no node has that"
    elif sum(per_node) < n:
        return f"{n} bundles of {_res(b)} are needed; the nodes hold {sum(per_node)}"
    return ""


def _res(d: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(d.items()))


def describe_nodes(nodes: list[dict], key: str = "Resources") -> str:
    """'2 nodes: 10.0.0.1 (8 CPU, 0 GPU), ...' from ray.nodes()-style entries."""
    parts = [f"{n.get('NodeManagerAddress', '?')} ({n[key].get('CPU', 0):g} CPU, {n[key].get('GPU', 0):g} GPU)"
             for n in nodes]
    return f"{len(nodes)} node(s): " + ", ".join(parts)


def create_placement_group(plan: PlacementPlan, timeout_s: float):
    """Reserve the bundles, or refuse (UserError) naming what the cluster has."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    why = unplaceable_reason(plan, [n["Resources"] for n in nodes])
    if why:
        raise UserError(f"The ranks cannot be placed on this Ray cluster: {why}. The cluster has "
                        f"{describe_nodes(nodes)}. Ask for fewer ranks (trainer.nprocs), another layout "
                        f"(trainer.nnodes / trainer.ranks_per_node / trainer.placement), or add nodes.",
                        title="unplaceable")
    pg = placement_group(plan.bundles, strategy=plan.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        free = ray.available_resources()
        raise UserError(f"The ranks' resources ({len(plan.bundles)} x {_res(plan.bundles[0])}, {plan.strategy}) "
                        f"were not free within {timeout_s:.0f}s: the cluster has {describe_nodes(nodes)}, of which "
                        f"{_res({k: v for k, v in free.items() if k in ('CPU', 'GPU')})} are free now. Other jobs "
                        f"hold the rest; retry later or ask for fewer ranks.", title="unplaceable")
    return pg
