"""The routers of a transformers mixture-of-experts model, found by class.

Supported: the routers that compute ``softmax -> top-k -> (renormalise)`` over the router's
logits and return ``(router_logits, routing_weights, selected_experts)`` (transformers 5.x
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Qwen3-Next). ``tests/test_moe_replay.py`` checks, for each
name below, that the installed class still computes its top-k that way, so a transformers
upgrade that changes a router fails a test instead of replaying wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import json_safe

# router class -> the attribute holding its expert count
ROUTER_CLASSES: dict[str, str] = {
    "MixtralTopKRouter": "num_experts",
    "Qwen2MoeTopKRouter": "num_experts",
    "Qwen3MoeTopKRouter": "num_experts",
    "OlmoeTopKRouter": "num_experts",
    "Qwen3NextTopKRouter": "num_experts",
}

# config.json keys that name an expert count (any > 0 means the model is a mixture of experts)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoELayout:
    """What a model's routing records look like: ``[tokens, layers, top_k]``."""

    layers: int          # routed layers (dense layers have no router and no record column)
    top_k: int
    num_experts: int
    router_names: tuple  # module names, in layer order


def _is_router(module: torch.nn.Module) -> bool:
    return any(c.__name__ in ROUTER_CLASSES for c in type(module).__mro__)


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, router) for every supported router, in module order (= layer order)."""
    return [(n, m) for n, m in model.named_modules() if _is_router(m)]


def moe_layout(model: torch.nn.Module) -> MoELayout | None:
    """The model's routing layout, or None when it has no supported router."""
    routers = find_routers(model)
    if not routers:
        return None
    ks = {int(m.top_k) for _, m in routers}
    es = {int(m.num_experts) for _, m in routers}
    if len(ks) != 1 or len(es) != 1:
        raise ValueError(f"routers disagree on top_k {sorted(ks)} / experts {sorted(es)}: one record layout "
                         "needs the same top-k in every layer")
    return MoELayout(layers=len(routers), top_k=ks.pop(), num_experts=es.pop(),
                     router_names=tuple(n for n, _ in routers))


def config_expert_count(config: dict) -> int:
    """Experts per MoE layer named by a model's config.json dict (0: a dense model). Looks
    inside ``text_config`` too (multimodal wrappers)."""
    for src in (config, config.get("text_config") or {}):
        for key in EXPERT_COUNT_KEYS:
            v = src.get(key)
            if isinstance(v, int) and v > 0:
                return v
    return 0


# config.json model_type of the architectures whose routers are in ROUTER_CLASSES
REPLAY_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "qwen3_next")


def check_replay_model(model_path: str, mode: str) -> None:
    """Refuse ``algorithm.router_replay=record|replay`` for a model without supported routers
    (reads config.json only; raises ConfigError)."""
    from pathlib import Path

    from engine.errors import ConfigError

    fix = "set algorithm.router_replay=off"
    if not model_path:
        raise ConfigError(f"`algorithm.router_replay={mode}` needs a mixture-of-experts model, but the tiny built-in "
                          f"model is dense (no experts to route). Set model.path to a local MoE model directory "
                          f"({', '.join(REPLAY_MODEL_TYPES)}), or {fix}.", title="invalid config")
    try:
        config = json_safe.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"`algorithm.router_replay={mode}`: cannot read {model_path}/config.json ({e}); point "
                          f"model.path at a Hugging Face model directory, or {fix}.", title="invalid model") from None
    kind = config.get("model_type", "?")
    if config_expert_count(config) == 0:
        raise ConfigError(f"`algorithm.router_replay={mode}` needs a mixture-of-experts model, but {model_path} "
                          f"(model_type={kind}) has no experts. Use an MoE model ({', '.join(REPLAY_MODEL_TYPES)}), "
                          f"or {fix}.", title="invalid config")
    if kind not in REPLAY_MODEL_TYPES:
        raise ConfigError(f"`algorithm.router_replay={mode}`: {model_path} is an MoE model (model_type={kind}) whose "
                          f"router is not supported yet (supported: {', '.join(REPLAY_MODEL_TYPES)}); {fix}.",
                          title="invalid config")
