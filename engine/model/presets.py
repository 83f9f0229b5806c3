"""Model presets: map ``model.preset`` (or an explicit ``model.path``) to a local HF directory.

``resolve_model_path(cfg.model)`` is the one place a run turns its model config into weights on
disk. It returns ``""`` for the tiny built-in model (built from the ``model.*`` dims, random
init), ``model.path`` when the user gave one, else the directory a preset resolver produces.
Resolvers never download; they work from locally installed packages and a cache.
"""

from __future__ import annotations

import difflib
from typing import Callable, Optional

from engine.config.schema import ModelConfig
from engine.errors import ConfigError
from engine.model.smollm2 import resolve_smollm2

# preset name -> resolver returning a local HF model directory; None = the tiny built-in model
PRESETS: dict[str, Optional[Callable[[], str]]] = {
    "tiny": None,
    "smollm2-135m": resolve_smollm2,
}


def resolve_model_path(model_cfg: ModelConfig) -> str:
    """Local HF model directory for this config, or "" for the tiny built-in model. ``model.path``
    may be a directory or a hub id in the local HF cache (engine/model/source.py)."""
    if model_cfg.path:
        from engine.model.source import resolve_path_or_hub_id

        return resolve_path_or_hub_id(model_cfg.path)
    name = model_cfg.preset
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"unknown model.preset '{name}'.{hint} Known presets: {', '.join(PRESETS)}; "
            "or set model.path to a local Hugging Face model directory."
        )
    resolver = PRESETS[name]
    return "" if resolver is None else resolver()
