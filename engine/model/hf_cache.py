"""The KV-cache keyword of a transformers model's forward, across transformers versions.

transformers renamed ``past_key_values`` to ``cache`` (5.2x; the old name warns until 5.40 removes
it) and returns the cache under the new name too. What a forward accepts is read from the model
underneath any wrapper whose own forward takes ``**kwargs`` and hides it: ``torch.compile``'s
``OptimizedModule`` (``_orig_mod``) and peft's ``PeftModel`` (``get_base_model()``).
"""

from __future__ import annotations

import inspect


def underlying(model):
    """The transformers model under torch.compile's and peft's wrappers (``model`` when none)."""
    for _ in range(8):  # (wrappers of wrappers; never a cycle)
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
            if inner is model:
                break
            model = inner
        else:
            break
    return model


def accepts(model, name: str) -> bool:
    """Whether the model's forward takes the keyword ``name``."""
    fwd = getattr(underlying(model), "forward", model)
    try:
        return name in inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False


def cache_kwarg(model) -> str:
    """``cache`` where the model's forward takes it, else ``past_key_values``."""
    return "cache" if accepts(model, "cache") else "past_key_values"


def returned_cache(out):
    """The cache a forward returned, under either name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
