"""Find and clear Transformer-Engine FP8 weight workspaces, and count the bytes they hold.

TE modules keep quantised copies of their weights in ``module._fp8_workspaces``: a dict
keyed ``weight`` (Linear, LayerNormLinear), ``fc1_weight``/``fc2_weight`` (LayerNormMLP) or
``weight0..N`` (GroupedLinear), filled when the forward is given ``is_first_microbatch``
(megatron-core passes it), whose values are quantised tensors (``Float8Tensor`` with
``_data``/``_transpose``/``_scale_inv``, ``MXFP8Tensor`` with ``_rowwise_data``/
``_columnwise_data``, ...). They are neither parameters nor buffers, so moving a model's
parameters to host leaves them on the device; on large FP8 models they hold tens of GiB per
rank. TE rebuilds them lazily on the next forward, so clearing them on every parameter
offload is safe.

The walk goes through every wrapper that is an ``nn.Module`` (FSDP2 ``fully_shard`` modules,
DDP, megatron-core DDP / Float16Module), through objects that only hold a ``.module``, and
through lists/tuples of model chunks (megatron virtual pipeline).

The byte-counting helpers here (``tensors_in``, ``storage_bytes``) are also what the offload
helpers and the memory tracker use: bytes are counted once per underlying storage, so views,
tied weights and transposes that share memory are not double counted.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

WORKSPACE_ATTR = "_fp8_workspaces"

# How deep tensors_in follows containers (workspace dict -> value -> its data tensors).
_MAX_DEPTH = 3


def iter_modules(model) -> Iterator[torch.nn.Module]:
    """Every distinct submodule of ``model`` (a module, a wrapper, or a list of chunks)."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        obj = stack.pop()
        if obj is None:
            continue
        if isinstance(obj, torch.nn.Module):
            for m in obj.modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    yield m
        elif isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "module"):          # non-Module wrappers that hold the model
            stack.append(obj.module)


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor subclass's data (DTensor local shard, Float8 data)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    inner: list[torch.Tensor] = []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner.extend(getattr(t, n) for n in names if isinstance(getattr(t, n, None), torch.Tensor))
    for v in getattr(t, "__dict__", {}).values():
        # tensors held directly, or one level down in a dict/list (older TE keeps the FP8
        # transpose in ``_fp8_attrs``)
        vals = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
        for x in vals:
            if isinstance(x, torch.Tensor) and all(x is not y for y in inner):
                inner.append(x)
    return inner


def tensors_in(obj, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Plain tensors reachable from ``obj``: a tensor (its inner tensors if it is a subclass),
    a dict/list/tuple of those, or an object whose attributes are tensors (one level: objects
    such as quantizers that merely *reference* shared state are not followed)."""
    if _depth > _MAX_DEPTH or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            yield obj
            return
        inner = _inner_tensors(obj)
        if inner:
            for t in inner:
                yield from tensors_in(t, _depth + 1)
        else:
            yield obj
        return
    if isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, _depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, _depth + 1)
    elif _depth == 0 or hasattr(obj, "__dict__"):
        for v in getattr(obj, "__dict__", {}).values():
            if isinstance(v, (torch.Tensor, list, tuple)):
                yield from tensors_in(v, _depth + 1)


def storage_key(t: torch.Tensor):
    """Identity of the memory behind ``t`` (same for views and for tensors sharing storage)."""
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
    except (RuntimeError, NotImplementedError):
        return ("obj", id(t))
    if ptr == 0:                               # meta, or an empty storage
        return ("obj", id(st) if t.device.type != "meta" else id(t))
    return (str(t.device), ptr)


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (the memory that freeing it would return)."""
    if t.device.type == "meta":
        return t.numel() * t.element_size()
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Total bytes of the distinct storages behind ``tensors`` (``seen`` is updated)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        k = storage_key(t)
        if k in seen:
            continue
        seen.add(k)
        total += tensor_nbytes(t)
    return total


def _workspace_dicts(model) -> Iterator[dict]:
    for m in iter_modules(model):
        ws = getattr(m, WORKSPACE_ATTR, None)
        if isinstance(ws, dict) and ws:
            yield ws


def fp8_workspace_bytes(model) -> tuple[int, int]:
    """(entries, bytes) of the FP8 workspaces currently held anywhere in ``model``."""
    count, seen, total = 0, set(), 0
    for ws in _workspace_dicts(model):
        count += len(ws)
        total += storage_bytes(tensors_in(list(ws.values())), seen)
    return count, total


def clear_fp8_workspaces(model) -> tuple[int, int]:
    """Clear every non-empty ``_fp8_workspaces`` dict in ``model``; returns (entries, bytes).

    ``bytes`` counts the distinct storages the cleared entries held; the memory is returned
    once nothing else (e.g. a live autograd graph) references them. TE rebuilds the entries
    on the next forward.
    """
    count, seen, total = 0, set(), 0
    for ws in _workspace_dicts(model):
        count += len(ws)
        total += storage_bytes(tensors_in(list(ws.values())), seen)
        ws.clear()
    return count, total
