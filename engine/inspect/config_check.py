"""Config check: saved config keys that the current `rl` removed or renamed.

Uses the removed-key registry that `rl train` uses (engine/config/removed_keys.py,
``REMOVED_KEYS: dict[str, RemovedKey]`` with ``key``, ``replacement``, ``reason``). If that
registry cannot be imported the check is skipped and the report says so.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from engine.inspect.report import ConfigIssue


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}`` (lists and scalars are leaves)."""
    out: dict[str, Any] = {}
    if isinstance(config, Mapping):
        for k, v in config.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) and v:
                out.update(flatten_config(v, key))
            else:
                out[key] = v
    elif prefix:
        out[prefix] = config
    return out


def load_registry() -> tuple[Optional[Mapping], str]:
    """The removed-key registry, or (None, why it is unavailable)."""
    try:
        from engine.config.removed_keys import REMOVED_KEYS
    except Exception as e:  # missing module or a broken one: the inspector still works
        return None, f"skipped: the removed-key registry is unavailable ({type(e).__name__}: {e})"
    return REMOVED_KEYS, ""


def check_config(config: Optional[Mapping], registry: Optional[Mapping] = None
                 ) -> tuple[list[ConfigIssue], str]:
    """Saved keys found in ``registry`` (default: the real one), and a one-line status."""
    if not config:
        return [], ""
    if registry is None:
        registry, why = load_registry()
        if registry is None:
            return [], why
    flat = flatten_config(config)
    issues: list[ConfigIssue] = []
    for key, entry in registry.items():
        hits = [k for k in flat if k == key or k.startswith(key + ".")]
        if not hits:
            continue
        issues.append(ConfigIssue(
            key=key,
            replacement=str(getattr(entry, "replacement", "") or ""),
            reason=str(getattr(entry, "reason", "") or ""),
            saved_value=flat[key] if key in flat else {h: flat[h] for h in hits}))
    status = (f"checked {len(flat)} saved keys against {len(registry)} removed/renamed keys: "
              f"{len(issues)} found")
    return issues, status
