"""Config keys that no longer exist, what replaces them and why.

One registry, used by `rl train` validation, `rl resume` config checks, `rl inspect-ckpt`
(saved configs with removed keys) and completion (never offers these).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemovedKey:
    key: str               # dotted path, e.g. "engine.grad_offload"
    replacement: str       # dotted path of what to use instead ("" when nothing replaces it)
    reason: str


REMOVED_KEYS: dict[str, RemovedKey] = {
    k.key: k
    for k in [
        RemovedKey(
            "engine.grad_offload",
            "engine.param_offload",
            "gradients follow param_offload, which offloads params and releases grad buffers "
            "while the engine is idle",
        ),
    ]
}


def removed_message(key: str) -> str | None:
    """The user-facing sentence for a removed key, or None if ``key`` was never removed."""
    entry = REMOVED_KEYS.get(key)
    if entry is None:
        return None
    fix = (f"Use `{entry.replacement}` instead" if entry.replacement
           else "Delete it from your overrides and YAML")
    return f"`{key}` was removed: {entry.reason}. {fix}."
