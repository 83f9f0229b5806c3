"""Reader for plain ``torch.save`` files (zip archives), and the tree walk other readers share.

The object tree comes from ``data.pkl`` through the restricted unpickler; tensors arrive as
:class:`~engine.checkpoint.io.safe_unpickle.TensorRef` (dtype, shape, storage key), so no tensor
data is read. :func:`flatten` turns the tree into named entries (``optimizer.state.0.exp_avg``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from engine.checkpoint.io.files import list_files
from engine.checkpoint.io.grouping import guess_group
from engine.inspect.report import CheckpointReport, ObjectInfo, TensorInfo
from engine.checkpoint.io.safe_unpickle import (DTypeName, NdarrayRef, NumpyScalar, Record,
                                          TensorRef, read_torch_archive)

_NUMPY_DTYPES = {"f8": "float64", "f4": "float32", "f2": "float16", "i8": "int64",
                 "i4": "int32", "i2": "int16", "i1": "int8", "u8": "uint64", "u4": "uint32",
                 "u2": "uint16", "u1": "uint8", "b1": "bool"}


def numpy_dtype_name(code: str) -> str:
    """numpy dtype code or name -> torch-style name ('u4' -> 'uint32')."""
    code = code.lstrip("<>=|")
    return _NUMPY_DTYPES.get(code, code)


def _is_leaf(x: Any) -> bool:
    return not isinstance(x, (dict, list, tuple)) or not _has_structure(x)


def _has_structure(x: Any, depth: int = 0) -> bool:
    """True if a list/tuple holds a tensor, an array or a mapping (worth walking into)."""
    if isinstance(x, (TensorRef, NdarrayRef, dict)):
        return True
    if isinstance(x, (list, tuple)) and depth < 3:
        return any(_has_structure(v, depth + 1) for v in x)
    return False


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, leaf) for every leaf; tuples/lists of plain values stay one leaf."""
    if isinstance(obj, dict):
        if not obj and prefix:
            yield prefix, obj
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            yield from flatten(v, key)
    elif isinstance(obj, (list, tuple)) and not _is_leaf(obj):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix or "<root>", obj


def preview(v: Any, limit: int = 60) -> str:
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"{type(v).__name__} of {len(v)}"
    s = repr(to_plain(v))
    return s if len(s) <= limit else s[: limit - 3] + "..."


def leaf_entry(name: str, v: Any, group: str) -> TensorInfo | ObjectInfo:
    """A flattened leaf as a TensorInfo (tensors, arrays) or an ObjectInfo (the rest)."""
    if isinstance(v, TensorRef):
        return TensorInfo(name=name, dtype=v.dtype, shape=v.shape, group=group,
                          placement=_placement(v))
    if isinstance(v, NdarrayRef):
        return TensorInfo(name=name, dtype=numpy_dtype_name(v.dtype), shape=v.shape,
                          group=group, placement="numpy")
    tname = v.qualname if isinstance(v, Record) else type(v).__name__
    return ObjectInfo(name=name, type=tname, group=group, preview=preview(v))


def _placement(t: TensorRef) -> str:
    if not t.placement:
        return ""
    return f"{t.placement} on {t.mesh_size} rank(s)" if t.mesh_size else t.placement


def entries(obj: Any, prefix: str = "", group: Callable[[str, bool], str] = guess_group
            ) -> tuple[list[TensorInfo], list[ObjectInfo]]:
    """Flatten ``obj`` into tensor and object entries, grouped by ``group(name, is_tensor)``."""
    tensors: list[TensorInfo] = []
    objects: list[ObjectInfo] = []
    for name, v in flatten(obj, prefix):
        e = leaf_entry(name, v, group(name, isinstance(v, (TensorRef, NdarrayRef))))
        (tensors if isinstance(e, TensorInfo) else objects).append(e)
    return tensors, objects


def to_plain(v: Any) -> Any:
    """A JSON-safe copy of an unpickled value (stand-ins become dicts/strings)."""
    if isinstance(v, DTypeName):
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): to_plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [to_plain(x) for x in v]
    if isinstance(v, TensorRef):
        return f"tensor({v.dtype}, {list(v.shape)})"
    if isinstance(v, NdarrayRef):
        return f"ndarray({v.dtype}, {list(v.shape)})"
    if isinstance(v, NumpyScalar):
        return v.value if v.value is not None else repr(v)
    if isinstance(v, Record):
        return {k: to_plain(x) for k, x in v.__dict__.items() if not k.startswith("_")}
    if isinstance(v, (bytes, bytearray)):
        return f"<{len(v)} bytes>"
    return repr(v)


def inspect_torch_save(path: Path, *, display: Optional[str] = None) -> CheckpointReport:
    """Report for a single ``torch.save`` file."""
    shown = display or str(path)
    archive = read_torch_archive(path, display=shown)
    tensors, objects = entries(archive.obj)
    rep = CheckpointReport(
        path=shown, format="torch-save",
        format_detail=f"torch.save zip archive ({len(archive.storages)} storages)",
        files=list_files(path), tensors=tensors, objects=objects)
    stored = sum(archive.storages.values())
    rep.info["storage_bytes"] = stored
    step = _find_step(archive.obj)
    if step is not None:
        rep.step = step
    return rep


def _find_step(obj: Any) -> Optional[int]:
    """A top-level integer 'step'/'global_step'/'iteration' entry, if the file has one."""
    if isinstance(obj, dict):
        for k in ("global_step", "step", "iteration", "epoch_step"):
            v = obj.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None
