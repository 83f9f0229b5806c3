"""Gradient checkpointing of a transformers model's layers, across transformers versions.

transformers 5 renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``
(the old name warns and goes in v6); both take the checkpoint function's keywords, the new one as
``activation_checkpointing_kwargs``.
"""

from __future__ import annotations


def enable_checkpointing(model, reentrant: bool | None = None) -> None:
    """Checkpoint ``model``'s layers: transformers' default mode (non-reentrant) when ``reentrant``
    is None, else ``use_reentrant=reentrant``."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    kwargs = {} if reentrant is None else {"use_reentrant": reentrant}
    if enable is not None:
        enable(**({"activation_checkpointing_kwargs": kwargs} if kwargs else {}))
    else:
        model.gradient_checkpointing_enable(**({"gradient_checkpointing_kwargs": kwargs} if kwargs else {}))
