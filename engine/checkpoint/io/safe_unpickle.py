"""Read checkpoint pickles without running any code from them.

DCP ``.metadata`` files and ``torch.save`` archives are pickles, and a pickle can call any
importable function while it loads (``__reduce__`` -> ``os.system``). This module's
:class:`RestrictedUnpickler` resolves a global only if it is on a fixed allow-list of the
names those formats use, and even then hands back an inert stand-in, never the real
class or function: dtypes become their names, ``torch.Size`` a tuple, a tensor a
:class:`TensorRef` (dtype, shape, storage key), the DCP metadata dataclasses plain
attribute bags (:class:`Record`). Anything else is refused with :class:`UnsafePickleError`
before it can be called. Tensor storages are never read: ``persistent_load`` records the
storage's key, dtype and element count from its persistent id.

Work is bounded, so a small hostile file cannot take the machine down: a pickle larger than
:data:`MAX_PICKLE_BYTES` is refused unread; ``bytes(n)``/``bytearray(n)`` allocations are
capped; and the loaded object tree is walked once (:func:`check_bounds`, iteratively) and
refused if it is deeper than :data:`MAX_DEPTH`, refers to itself, or would expand, counting
shared references each time they are reached, to more than :func:`node_budget` nodes
(proportional to the file's size). Every later walk (flattening, previews, JSON) is then
bounded too: never a ``RecursionError`` or ``MemoryError``.

torch itself is never imported here, so inspecting costs what the metadata costs.
"""

from __future__ import annotations

import builtins
import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from engine.errors import CheckpointError
from engine.checkpoint.io.dtypes import is_dtype_name, storage_dtype


class UnsafePickleError(CheckpointError):
    """A pickle refers to a class or function that no checkpoint format needs."""


MAX_PICKLE_BYTES = 1 << 30     # a pickle (data.pkl, .metadata) larger than this is refused unread
MAX_DEPTH = 100                # nesting of containers in the loaded tree
MIN_NODE_BUDGET = 200_000      # nodes a walk may visit, at least ...
NODES_PER_BYTE = 4             # ... or this many per byte of pickle: work stays proportional to input
MAX_ALLOC_BYTES = 64 << 20     # bytes(n) / bytearray(n) built from an integer n


def node_budget(pickle_bytes: int) -> int:
    return max(MIN_NODE_BUDGET, NODES_PER_BYTE * pickle_bytes)


class PickleTooLargeError(CheckpointError):
    """A pickle whose object tree is too deep, cyclic, or expands beyond the node budget."""


# ---------------------------------------------------------------------------------------
# Stand-ins


class DTypeName(str):
    """A torch dtype seen in a pickle (``torch.float32`` -> ``DTypeName("float32")``)."""


class Record:
    """Inert stand-in for an allowed class: keeps constructor args and state as attributes.

    Subclasses are made per allowed name by :func:`_record_type`; ``qualname`` says which.
    Nothing of the real class runs: construction and ``__setstate__`` only store data.
    """

    qualname = "Record"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.__dict__["_args"] = args
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif (isinstance(state, tuple) and len(state) == 2
              and all(s is None or isinstance(s, dict) for s in state)):
            for part in state:  # (instance dict, slot values)
                if part:
                    self.__dict__.update(part)
        else:
            self.__dict__["_state"] = state

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return f"<{self.qualname} {fields or self.__dict__.get('_args', '')}>"


class TensorPropertiesRecord(Record):
    """DCP's TensorProperties, whose pickled state is a tuple starting with the dtype."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and state:
            self.__dict__["dtype"] = state[0]
        else:
            super().__setstate__(state)


_RECORD_TYPES: dict[str, type] = {}


def _record_type(qualname: str, base: type = Record) -> type:
    """The stand-in class for ``qualname`` (one per name, so identity checks work)."""
    t = _RECORD_TYPES.get(qualname)
    if t is None:
        t = type(qualname.rsplit(".", 1)[-1], (base,), {"qualname": qualname})
        _RECORD_TYPES[qualname] = t
    return t


@dataclass(eq=False)
class StorageRef:
    """A tensor storage named by a pickle's persistent id. Its bytes are never read."""

    key: str
    dtype: Optional[str]  # None for an untyped storage (the tensor says the dtype)
    numel: int  # elements (bytes for an untyped storage)
    location: str = ""


@dataclass(eq=False)
class TensorRef:
    """A tensor rebuilt as metadata only."""

    dtype: str
    shape: tuple[int, ...]
    storage: Optional[StorageRef] = None
    subclass: str = ""  # e.g. torch.distributed.tensor.DTensor
    local_shape: Optional[tuple[int, ...]] = None  # DTensor: this rank's piece
    placement: str = ""  # DTensor: e.g. "Shard(0)"
    mesh_size: Optional[int] = None
    is_parameter: bool = False


@dataclass(eq=False)
class NdarrayRef:
    """A numpy array rebuilt as metadata only."""

    shape: tuple[int, ...] = ()
    dtype: str = ""

    def __setstate__(self, state):
        # ndarray state: (version, shape, dtype, is_fortran, rawdata)
        if isinstance(state, tuple) and len(state) >= 3:
            self.shape = tuple(int(d) for d in state[1])
            self.dtype = str(getattr(state[2], "name", state[2]))


class NumpyDTypeRecord(Record):
    qualname = "numpy.dtype"

    @property
    def name(self) -> str:
        args = self.__dict__.get("_args") or ("?",)
        return str(args[0])


@dataclass(eq=False)
class NumpyScalar:
    """A numpy scalar: decoded for plain numeric types, else shown by dtype."""

    dtype: str
    value: Any = None

    def __repr__(self) -> str:
        return repr(self.value) if self.value is not None else f"<numpy {self.dtype}>"


class StorageTypeRecord(Record):
    """``torch.FloatStorage`` and friends (or ``torch.storage.UntypedStorage``)."""

    dtype: Optional[str] = None


# ---------------------------------------------------------------------------------------
# The allowed callables (all inert)


def _size(dims=()):
    return tuple(int(d) for d in dims)


def _device(*args):
    return ":".join(str(a) for a in args)


def _get_layout(name):
    return str(name)


def _path(*parts):
    return "/".join(str(p) for p in parts)


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    if str(encoding).lower().replace("-", "") not in ("latin1", "utf8"):
        raise UnsafePickleError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return str(obj).encode(encoding, errors)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    dtype = storage.dtype if isinstance(storage, StorageRef) and storage.dtype else "unknown"
    return TensorRef(dtype=str(dtype), shape=_size(size), storage=_as_storage(storage))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       dtype, metadata=None):
    return TensorRef(dtype=str(dtype), shape=_size(size), storage=_as_storage(storage))


def _rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad=False):
    return TensorRef(dtype=str(dtype), shape=_size(size))


def _rebuild_parameter(data, requires_grad=True, backward_hooks=None):
    if isinstance(data, TensorRef):
        data.is_parameter = True
    return data


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    return _rebuild_parameter(data)


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device,
                              requires_grad):
    return TensorRef(dtype=str(dtype), shape=_size(size),
                     subclass=getattr(cls, "qualname", str(cls)))


def _rebuild_from_type_v2(func, new_type, args, state):
    if func not in _REBUILD_FUNCS:
        raise UnsafePickleError(f"tensor rebuilt by {func!r}, which is not a tensor rebuild function")
    ret = func(*args)
    if isinstance(ret, TensorRef):
        sub = getattr(new_type, "qualname", "")
        if sub and not ret.subclass and sub not in _PLAIN_TENSOR_TYPES:
            ret.subclass = sub
        _apply_tensor_state(ret, state)
    return ret


def _as_storage(storage) -> Optional[StorageRef]:
    return storage if isinstance(storage, StorageRef) else None


def _apply_tensor_state(t: TensorRef, state) -> None:
    """Take what a DTensor's pickled state says about its local piece and placement."""
    attrs: dict = {}
    if isinstance(state, dict):
        attrs = state
    elif isinstance(state, tuple):
        for part in state:
            if isinstance(part, dict):
                attrs.update(part)
    local = attrs.get("_local_tensor")
    if isinstance(local, TensorRef):
        t.local_shape = local.shape
        t.storage = local.storage
    spec = attrs.get("_spec")
    if isinstance(spec, Record):
        placements = spec.__dict__.get("placements") or ()
        t.placement = ", ".join(_placement_str(p) for p in placements)
        t.mesh_size = _mesh_size(spec.__dict__.get("mesh"))


def _placement_str(p) -> str:
    if not isinstance(p, Record):
        return str(p)
    name = p.qualname.rsplit(".", 1)[-1].lstrip("_")
    if "dim" in p.__dict__:
        return f"{name}({p.__dict__['dim']})"
    if "reduce_op" in p.__dict__:
        return f"{name}({p.__dict__['reduce_op']})"
    return f"{name}()"


def _mesh_size(mesh) -> Optional[int]:
    if not isinstance(mesh, Record):
        return None
    for attr in ("_rank_map", "mesh"):
        t = mesh.__dict__.get(attr)
        if isinstance(t, TensorRef):
            n = 1
            for d in t.shape:
                n *= d
            return n
    return None


def _np_reconstruct(cls, shape, dtype_code):
    return NdarrayRef()


_SCALAR_FORMATS = {"float64": "d", "float32": "f", "int64": "q", "int32": "i", "int16": "h",
                   "int8": "b", "uint64": "Q", "uint32": "I", "uint16": "H", "uint8": "B",
                   "bool": "?", "f8": "d", "f4": "f", "i8": "q", "i4": "i", "u4": "I",
                   "u8": "Q", "b1": "?"}


def _np_scalar(dtype, raw=None):
    name = dtype.name if isinstance(dtype, NumpyDTypeRecord) else str(dtype)
    value = None
    fmt = _SCALAR_FORMATS.get(name)
    if fmt and isinstance(raw, (bytes, bytearray)) and len(raw) == struct.calcsize(fmt):
        value = struct.unpack("<" + fmt, raw)[0]
    return NumpyScalar(dtype=name, value=value)


_REBUILD_FUNCS = {_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_wrapper_subclass,
                  _rebuild_meta_tensor_no_storage, _rebuild_parameter}

_PLAIN_TENSOR_TYPES = {"torch.Tensor", "torch.nn.parameter.Parameter",
                       "torch.nn.parameter.Buffer"}


def _bounded_alloc(kind: type):
    def build(*args):
        if args and isinstance(args[0], int) and not isinstance(args[0], bool) and args[0] > MAX_ALLOC_BYTES:
            raise PickleTooLargeError(f"the pickle asks for {kind.__name__}({args[0]:,}): more than "
                                      f"{MAX_ALLOC_BYTES:,} bytes from one integer; refused.",
                                      title="checkpoint too large")
        return kind(*args)

    build.__name__ = kind.__name__
    return build


def _records(module: str, *names: str, base: type = Record) -> dict:
    return {(module, n): _record_type(f"{module}.{n}", base) for n in names}


_ALLOWED: dict[tuple[str, str], Any] = {
    # Python containers and scalars (pure data)
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    **{("builtins", n): getattr(builtins, n)
       for n in ("set", "frozenset", "complex", "slice", "list", "dict", "tuple",
                 "int", "float", "str", "bool")},
    ("builtins", "bytes"): _bounded_alloc(bytes),
    ("builtins", "bytearray"): _bounded_alloc(bytearray),
    ("_codecs", "encode"): _codecs_encode,
    ("argparse", "Namespace"): _record_type("argparse.Namespace"),
    **{("pathlib", n): _path for n in ("Path", "PosixPath", "WindowsPath", "PurePath",
                                        "PurePosixPath", "PureWindowsPath")},
    # torch scalars and tensor rebuilds
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("torch", "Tensor"): _record_type("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _record_type("torch.nn.parameter.Parameter"),
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch.storage", "UntypedStorage"): _record_type("torch.storage.UntypedStorage", StorageTypeRecord),
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): _rebuild_meta_tensor_no_storage,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    # torch.distributed.checkpoint metadata
    **_records("torch.distributed.checkpoint.metadata", "Metadata", "TensorStorageMetadata",
               "BytesStorageMetadata", "ChunkStorageMetadata", "StorageMeta", "MetadataIndex",
               "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"):
        _record_type("torch.distributed.checkpoint.metadata.TensorProperties", TensorPropertiesRecord),
    **_records("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    **_records("torch.distributed.checkpoint.planner", "SavePlan", "WriteItem", "TensorWriteData",
               "WriteItemType", "LoadPlan", "ReadItem", "LoadItemType", "BytesIOWriteData"),
    # DTensor (FSDP2 / verl sharded state dicts)
    **_records("torch.distributed.tensor", "DTensor"),
    **_records("torch.distributed.tensor._api", "DTensor"),
    **_records("torch.distributed._tensor.api", "DTensor"),
    **_records("torch.distributed.tensor._dtensor_spec", "DTensorSpec", "TensorMeta", "ShardOrderEntry"),
    **_records("torch.distributed._tensor.placement_types", "DTensorSpec", "TensorMeta", "Shard",
               "Replicate", "Partial", "_Partial"),
    **_records("torch.distributed.tensor.placement_types", "Shard", "Replicate", "Partial",
               "_Partial", "_StridedShard", "MaskPartial"),
    **_records("torch.distributed.device_mesh", "DeviceMesh"),
    **_records("torch.distributed._mesh_layout", "_MeshLayout", "_FlatLayout"),
    # numpy arrays and scalars (RNG states, scheduler values)
    ("numpy", "ndarray"): _record_type("numpy.ndarray"),
    ("numpy", "dtype"): NumpyDTypeRecord,
    ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,
    ("numpy.core.multiarray", "scalar"): _np_scalar,
    ("numpy._core.multiarray", "scalar"): _np_scalar,
}


def allowed_names() -> list[str]:
    """Every ``module.name`` the restricted unpickler admits (for docs and errors)."""
    names = [f"{m}.{n}" for m, n in _ALLOWED]
    names += ["torch.<dtype> (float32, bfloat16, ...)", "torch.<Type>Storage",
              "numpy.dtypes.<Type>DType"]
    return sorted(names)


# ---------------------------------------------------------------------------------------
# The unpickler


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that admits only the globals checkpoint formats need.

    ``source`` names the file in error messages. ``persistent_load`` receives persistent
    ids (torch.save storages); without one, a persistent id is refused.
    """

    def __init__(self, file, *, source: str,
                 persistent_load: Optional[Callable[[Any], Any]] = None):
        super().__init__(file)
        self._source = source
        self._persistent = persistent_load

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and is_dtype_name(name):
            return DTypeName(name)
        if module == "torch" and storage_dtype(name):
            t = _record_type(f"torch.{name}", StorageTypeRecord)
            t.dtype = storage_dtype(name)
            return t
        if module == "numpy.dtypes" and name.endswith("DType"):
            return _record_type(f"numpy.dtypes.{name}")
        raise UnsafePickleError(
            f"{self._source} refers to `{module}.{name}`, which no checkpoint format needs; "
            "refused without running it. The file may be crafted to run code when loaded. "
            "If you made it yourself and trust it, load it with "
            "torch.load(path, weights_only=False) in your own script instead.",
            title="unsafe checkpoint")

    def persistent_load(self, pid):
        if self._persistent is None:
            raise UnsafePickleError(
                f"{self._source} holds an external reference ({_short(pid)}) where plain "
                "metadata was expected; refused.", title="unsafe checkpoint")
        return self._persistent(pid)


def _short(obj, limit: int = 80) -> str:
    s = repr(obj)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def load_pickle(data: bytes, *, source: str,
                persistent_load: Optional[Callable[[Any], Any]] = None) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`, mapping every failure to a
    :class:`CheckpointError` that names ``source``; the result passes :func:`check_bounds`."""
    if len(data) > MAX_PICKLE_BYTES:
        raise PickleTooLargeError(f"{source} is a {len(data):,}-byte pickle; rl reads pickles of at most "
                                  f"{MAX_PICKLE_BYTES:,} bytes (checkpoint metadata is far smaller).",
                                  title="checkpoint too large")
    try:
        obj = RestrictedUnpickler(io.BytesIO(data), source=source,
                                  persistent_load=persistent_load).load()
    except CheckpointError:
        raise
    except (RecursionError, MemoryError) as e:
        raise PickleTooLargeError(f"{source} could not be unpickled within bounds ({type(e).__name__}); "
                                  "refused.", title="checkpoint too large") from None
    except Exception as e:  # anything else while reading untrusted bytes means "corrupt"
        raise CheckpointError(
            f"{source} is truncated or corrupt (reading it as a pickle failed: "
            f"{type(e).__name__}: {e}). Copy it again from the machine that wrote it, or pick "
            "another checkpoint.", title="corrupt checkpoint") from None
    check_bounds(obj, source=source, budget=node_budget(len(data)))
    return obj


def _children(x: Any):
    if isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield v
    elif isinstance(x, (list, tuple, set, frozenset)):
        yield from x
    elif isinstance(x, Record):
        yield from x.__dict__.values()


def check_bounds(obj: Any, *, source: str, budget: int, max_depth: int = MAX_DEPTH) -> int:
    """Walk ``obj`` once, iteratively, as the readers later will (shared references are
    counted each time they are reached). Refuses a cycle, nesting deeper than ``max_depth``,
    or more than ``budget`` nodes. Returns the node count."""
    seen = 0
    on_path: set[int] = set()
    stack: list[tuple[Any, int, bool]] = [(obj, 0, False)]
    while stack:
        x, depth, leaving = stack.pop()
        if leaving:
            on_path.discard(id(x))
            continue
        seen += 1
        if seen > budget:
            raise PickleTooLargeError(
                f"{source} expands to more than {budget:,} objects (containers that share references can "
                "describe billions of entries in a few bytes); refused before walking it. A real checkpoint's "
                "metadata is far smaller.", title="checkpoint too large")
        if not isinstance(x, (dict, list, tuple, set, frozenset, Record)):
            continue
        if id(x) in on_path:
            raise PickleTooLargeError(f"{source} holds a container that contains itself; no checkpoint "
                                      "format writes that. Refused.", title="corrupt checkpoint")
        if depth >= max_depth:
            raise PickleTooLargeError(f"{source} nests containers more than {max_depth} deep; no checkpoint "
                                      "format writes that. Refused.", title="corrupt checkpoint")
        on_path.add(id(x))
        stack.append((x, depth, True))
        for c in _children(x):
            stack.append((c, depth + 1, False))
    return seen


# ---------------------------------------------------------------------------------------
# torch.save archives


@dataclass
class TorchArchive:
    """What a ``torch.save`` zip archive holds, read without touching tensor data."""

    obj: Any  # the saved object, tensors as TensorRef, arrays as NdarrayRef
    storages: dict[str, int] = field(default_factory=dict)  # storage key -> bytes on disk
    archive_name: str = ""


ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.save's pre-1.6 format starts by pickling this


def read_torch_archive(path: Path, *, display: Optional[str] = None) -> TorchArchive:
    """Read a ``torch.save`` file's object tree (``data.pkl``) and its storages' sizes.

    Only ``data.pkl`` and the zip directory are read; storage records are sized from the
    directory. Raises :class:`CheckpointError` for anything that is not a readable archive
    (including anything that is not a regular file: a FIFO or device is never opened).
    """
    source = display or str(path)
    from engine.checkpoint.io.files import require_regular_file

    require_regular_file(Path(path), source)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise CheckpointError(f"cannot read {source}: {e.strerror}.") from None
    return _read_archive(path, head, source)


def read_torch_archive_bytes(data: bytes, *, display: str) -> TorchArchive:
    """Like :func:`read_torch_archive`, for a ``torch.save`` archive held in memory (DCP stores
    each non-tensor entry as one)."""
    return _read_archive(io.BytesIO(data), data[:4], display)


def _read_archive(path, head: bytes, source: str) -> TorchArchive:
    if head != ZIP_MAGIC:
        if head[:2] == b"\x80\x02":
            raise CheckpointError(
                f"{source} uses torch.save's legacy (pre-1.6, non-zip) format, which "
                "rl inspect-ckpt does not read. Re-save it with a current torch "
                "(torch.save(torch.load(p), p)) if you trust it.", title="unsupported checkpoint")
        raise CheckpointError(
            f"{source} is not a torch.save archive (it does not start with a zip header"
            f"{'; the file is empty' if not head else ''}). It may be truncated or another "
            "format.", title="corrupt checkpoint")
    try:
        zf = zipfile.ZipFile(path)
    except Exception as e:  # BadZipFile, OSError, and whatever a crafted directory provokes
        raise CheckpointError(
            f"{source} is truncated or corrupt: its zip directory cannot be read ({e}). "
            "A torch.save file is unusable without it; copy it again or pick another "
            "checkpoint.", title="corrupt checkpoint") from None
    with zf:
        infos = zf.infolist()
        pkl = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if not pkl:
            raise CheckpointError(
                f"{source} is a zip file but not a torch.save archive (no <name>/data.pkl "
                "inside).", title="unsupported checkpoint")
        archive = pkl[0].filename.split("/", 1)[0]
        prefix = f"{archive}/data/"
        storages = {i.filename[len(prefix):]: i.file_size
                    for i in infos if i.filename.startswith(prefix)}
        if pkl[0].file_size > MAX_PICKLE_BYTES:
            raise PickleTooLargeError(f"{source}: data.pkl says it is {pkl[0].file_size:,} bytes; rl reads "
                                      f"pickles of at most {MAX_PICKLE_BYTES:,} bytes.", title="checkpoint too large")
        try:
            with zf.open(pkl[0]) as member:  # never trust the declared size: read at most the cap
                data = member.read(MAX_PICKLE_BYTES + 1)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
            raise CheckpointError(f"{source}: data.pkl cannot be read ({e}); the file is "
                                  "corrupt.", title="corrupt checkpoint") from None

    def persistent_load(pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"{source}: unexpected persistent id {_short(pid)}; refused.",
                                    title="unsafe checkpoint")
        _, stype, key, location, numel = pid[:5]
        dtype = getattr(stype, "dtype", None)
        key = str(key)
        if key not in storages:
            raise CheckpointError(f"{source}: storage {key} is listed in data.pkl but missing "
                                  "from the archive; the file is corrupt.",
                                  title="corrupt checkpoint")
        return StorageRef(key=key, dtype=dtype, numel=int(numel), location=str(location))

    obj = load_pickle(data, source=source, persistent_load=persistent_load)
    return TorchArchive(obj=obj, storages=storages, archive_name=archive)
