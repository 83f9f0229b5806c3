"""Mixture-of-experts structure read from a checkpoint's tensor names and shapes (no values):
how many experts each layer holds, and how many parameters sit in experts and routers.

Layouts recognised (model tensors only; optimizer entries are ignored):

- fused experts (transformers 5.x Mixtral, Qwen-MoE, OLMoE): ``layers.N.mlp.experts.gate_up_proj``
  / ``down_proj`` shaped ``[experts, ...]``;
- one module per expert (Hugging Face hub files, transformers 4.x, Megatron's SequentialMLP):
  ``layers.N.<...>.experts.E.<...>`` / ``local_experts.E``; Megatron's grouped GEMM
  ``experts.linear_fc1.weightE``;
- routers: ``layers.N.<...>.(gate|router).weight`` shaped ``[experts, hidden]`` in a layer that
  has experts (``shared_expert_gate`` is a one-row gate, not a router).
"""

from __future__ import annotations

import re
from typing import Optional

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"\.(?:local_)?experts\.(\d+)\.")
_GROUPED = re.compile(r"\.experts\.linear_fc\d\.weight(\d+)$")
_FUSED = re.compile(r"\.experts\.[A-Za-z_]+(?:\.weight)?$")
_ROUTER = re.compile(r"\.(?:gate|router)\.weight$")


def expert_summary(tensors) -> Optional[dict]:
    """{"moe_layers", "experts_per_layer", "expert_params", "router_params", "dense_layers"}
    for the ``model``-group tensors, or None when no layer has experts. ``experts_per_layer`` is
    one int when every MoE layer has the same count, else {layer: count}."""
    experts: dict[int, int] = {}
    expert_params = 0
    routers: dict[int, tuple[int, int]] = {}
    layers: set[int] = set()
    for t in tensors:
        if getattr(t, "group", "model") != "model":
            continue
        m = _LAYER.search(t.name)
        if m is None:
            continue
        layer = int(m.group(1))
        layers.add(layer)
        if ".experts." in t.name and "shared_expert" not in t.name:
            expert_params += t.numel
            e = _PER_EXPERT.search(t.name) or _GROUPED.search(t.name)
            if e is not None:
                experts[layer] = max(experts.get(layer, 0), int(e.group(1)) + 1)
            elif _FUSED.search(t.name) and len(t.shape) == 3:
                experts[layer] = max(experts.get(layer, 0), int(t.shape[0]))
        elif _ROUTER.search(t.name) and "shared_expert" not in t.name and len(t.shape) == 2:
            routers[layer] = (int(t.shape[0]), t.numel)
    if not experts:
        return None
    router_params = sum(n for layer, (_, n) in routers.items() if layer in experts)
    counts = set(experts.values())
    per_layer = counts.pop() if len(counts) == 1 else {str(k): v for k, v in sorted(experts.items())}
    return {"moe_layers": len(experts), "experts_per_layer": per_layer, "expert_params": expert_params,
            "router_params": router_params, "dense_layers": len(layers - set(experts))}
