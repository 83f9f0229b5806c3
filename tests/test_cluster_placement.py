"""Placement logic (engine/trainer/placement.py): the bundles asked of Ray for a node layout,
and the refusal of requests no arrangement of the cluster's nodes can hold."""

from __future__ import annotations

import pytest

from engine.config.validate import check_cross_field
from engine.errors import ConfigError
from engine.trainer.placement import describe_nodes, plan_placement, unplaceable_reason


def test_default_is_one_bundle_per_rank_packed():
    p = plan_placement(4, 0, 0, "PACK", gpus_per_rank=1)
    assert p.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 4 and p.strategy == "PACK"
    assert p.bundle_of_rank == [0, 1, 2, 3]
    assert plan_placement(2, 0, 0, "SPREAD", 0).bundles == [{"CPU": 1.0}] * 2


def test_nnodes_gives_one_strict_spread_bundle_per_node_with_contiguous_ranks():
    p = plan_placement(16, 2, 8, "PACK", gpus_per_rank=1)
    assert p.bundles == [{"CPU": 8.0, "GPU": 8.0}] * 2 and p.strategy == "STRICT_SPREAD"
    assert p.bundle_of_rank == [0] * 8 + [1] * 8
    one = plan_placement(4, 1, 0, "PACK", 0)
    assert one.strategy == "STRICT_PACK" and one.bundles == [{"CPU": 4.0}]


def test_unplaceable_requests_are_named():
    gpu_nodes = [{"CPU": 32.0, "GPU": 4.0}]
    assert "8 bundles" in unplaceable_reason(plan_placement(8, 0, 0, "PACK", 1), gpu_nodes)
    assert unplaceable_reason(plan_placement(4, 0, 0, "PACK", 1), gpu_nodes) == ""
    two = [{"CPU": 1.0}, {"CPU": 1.0}]
    assert unplaceable_reason(plan_placement(2, 2, 1, "PACK", 0), two) == ""
    assert "3 distinct nodes" in unplaceable_reason(plan_placement(3, 3, 1, "PACK", 0), two)
    assert "one node with 2 CPU" in unplaceable_reason(plan_placement(2, 1, 2, "PACK", 0), two)
    assert "3 bundles" in unplaceable_reason(plan_placement(3, 0, 0, "SPREAD", 0), two)


def test_describe_nodes_lists_address_and_resources():
    nodes = [{"NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "GPU": 2.0}}]
    assert describe_nodes(nodes) == "1 node(s): 10.0.0.1 (8 CPU, 2 GPU)"


@pytest.mark.parametrize("nprocs,nnodes,per_node", [(3, 2, 0), (4, 2, 1), (2, 0, 1)])
def test_node_layout_must_match_nprocs(nprocs, nnodes, per_node):
    from engine.config.validate import build_run_config

    with pytest.raises(ConfigError, match="trainer.n"):
        build_run_config({"trainer": {"nprocs": nprocs, "nnodes": nnodes, "ranks_per_node": per_node}})
    check_cross_field(build_run_config({"trainer": {"nprocs": 4, "nnodes": 2}}))
