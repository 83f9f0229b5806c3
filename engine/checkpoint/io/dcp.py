"""Reader for torch.distributed.checkpoint (DCP) directories: ``.metadata`` + ``*.distcp``.

``.metadata`` is a pickle of DCP's ``Metadata`` dataclass; it is read with the restricted
unpickler (:mod:`engine.checkpoint.io.safe_unpickle`), never with ``pickle.load``. Every tensor's
dtype, global shape and chunks, every non-tensor entry, and where each piece lives
(file, offset, length) come from it; the ``.distcp`` data files are only ``stat``-ed, to
check they are as long as the metadata says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from engine.errors import CheckpointError
from engine.checkpoint.io.files import human_bytes, list_files
from engine.checkpoint.io.grouping import guess_group
from engine.checkpoint.io.records import FileInfo, ObjectInfo, TensorInfo
from engine.checkpoint.io.safe_unpickle import Record, load_pickle

METADATA_FILE = ".metadata"
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")


@dataclass
class DcpContents:
    """What a DCP directory's metadata says, plus the data-file checks."""

    tensors: list[TensorInfo] = field(default_factory=list)
    objects: list[ObjectInfo] = field(default_factory=list)
    files: list[FileInfo] = field(default_factory=list)
    writer_ranks: list[int] = field(default_factory=list)  # ranks that wrote __<rank>_*.distcp
    version: Optional[str] = None
    problems: list[str] = field(default_factory=list)  # truncated or missing data files
    notes: list[str] = field(default_factory=list)
    # non-tensor entries: name -> (data file, offset, length, transformed) of its pickled bytes
    object_locations: dict[str, tuple[str, int, int, bool]] = field(default_factory=dict)


def is_dcp_dir(path: Path) -> bool:
    return path.is_dir() and ((path / METADATA_FILE).is_file()
                              or any(_DATA_FILE.match(p.name) for p in path.iterdir()))


def _attr(rec, name, default=None):
    return rec.__dict__.get(name, default) if isinstance(rec, Record) else default


def read_dcp(root: Path, *, display: Optional[str] = None,
             group: Callable[[str, bool], str] = guess_group) -> DcpContents:
    """Read a DCP directory's metadata. Raises CheckpointError if it cannot be read.

    Data-file problems (missing, shorter than the metadata says) are returned in
    ``problems``; the caller decides whether they make the checkpoint unusable.
    """
    shown = display or str(root)
    meta_path = root / METADATA_FILE
    if not meta_path.is_file():
        rank_meta = sorted(p.name for p in root.iterdir() if _RANK_METADATA.match(p.name)) \
            if root.is_dir() else []
        if rank_meta:
            raise CheckpointError(
                f"{shown} has per-rank metadata ({', '.join(rank_meta[:4])}) but no global "
                f"{METADATA_FILE}: it was saved with no_dist/without a coordinator. "
                "rl inspect-ckpt reads the global .metadata only.",
                title="unsupported checkpoint")
        data = sorted(p.name for p in root.iterdir() if _DATA_FILE.match(p.name)) \
            if root.is_dir() else []
        raise CheckpointError(
            f"{shown} has no {METADATA_FILE}"
            + (f" but {len(data)} data file(s) ({', '.join(data[:3])})" if data else "")
            + ". DCP writes .metadata last, so the save that wrote this directory did not "
            "finish. Pick another checkpoint (or re-save this one).",
            title="incomplete checkpoint")
    from engine.checkpoint.io.files import require_regular_file

    require_regular_file(meta_path, f"{shown}/{METADATA_FILE}")
    md = load_pickle(meta_path.read_bytes(), source=f"{shown}/{METADATA_FILE}")
    sdm = _attr(md, "state_dict_metadata")
    if not isinstance(sdm, dict):
        raise CheckpointError(
            f"{shown}/{METADATA_FILE} is not torch.distributed.checkpoint metadata (it holds "
            f"{type(md).__name__}); the file is corrupt or from another program.",
            title="corrupt checkpoint")

    out = DcpContents(version=_attr(md, "version"))
    out_locations: dict[str, tuple[str, int, int, bool]] = {}
    stored: dict[str, int] = {}
    transformed: set[str] = set()  # entries stored through a stream transform (compressed): no size floor
    ends: dict[str, int] = {}
    storage_data = _attr(md, "storage_data")
    if isinstance(storage_data, dict):
        for index, info in storage_data.items():
            rel, off, length = _attr(info, "relative_path"), _attr(info, "offset"), _attr(info, "length")
            if not isinstance(rel, str) or not isinstance(off, int) or not isinstance(length, int):
                continue
            fqn = _attr(index, "fqn", "")
            stored[fqn] = stored.get(fqn, 0) + length
            if _attr(info, "transform_descriptors"):
                transformed.add(fqn)
            if isinstance(fqn, str):
                out_locations[fqn] = (rel, off, length, fqn in transformed)
            ends[rel] = max(ends.get(rel, 0), off + length)
    else:
        out.notes.append("storage layout is not the filesystem writer's: data files not checked")

    for name, entry in sdm.items():
        qual = getattr(entry, "qualname", "")
        if qual.endswith("TensorStorageMetadata"):
            props = _attr(entry, "properties")
            dtype = str(_attr(props, "dtype", "unknown"))
            size = tuple(int(d) for d in (_attr(entry, "size") or ()))
            chunks = _attr(entry, "chunks") or []
            out.tensors.append(TensorInfo(name=name, dtype=dtype, shape=size,
                                          shards=max(1, len(chunks)), group=group(name, True)))
            problem = _size_claim_problem(name, dtype, size, stored.get(name), name in transformed)
            if problem and isinstance(storage_data, dict):
                out.problems.append(problem)
        elif qual.endswith("BytesStorageMetadata"):
            out.objects.append(ObjectInfo(name=name, type="bytes", group=group(name, False),
                                          stored_bytes=stored.get(name)))
            if name in out_locations:
                out.object_locations[name] = out_locations[name]
        else:
            raise CheckpointError(
                f"{shown}/{METADATA_FILE}: entry {name!r} has unknown storage type "
                f"{qual or type(entry).__name__}; the file is corrupt or from a newer torch.",
                title="corrupt checkpoint")

    out.files = list_files(root)
    sizes = {f.path: f.bytes for f in out.files}
    for rel, end in sorted(ends.items()):
        if rel not in sizes:
            out.problems.append(f"{rel} is missing (the metadata stores data in it)")
        elif sizes[rel] < end:
            out.problems.append(f"{rel} is truncated: {human_bytes(sizes[rel])} on disk, the "
                                f"metadata stores data up to byte {end:,}")
    out.writer_ranks = sorted({int(m.group(1)) for f in out.files
                               if (m := _DATA_FILE.match(f.path))})
    return out


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
             "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8}


def _size_claim_problem(name: str, dtype: str, size: tuple, stored: Optional[int], transformed: bool) -> str:
    """'' when the bytes the metadata stores for a tensor can hold the shape it claims, else why
    not. DCP's filesystem writer stores every element (plus a torch.save header) and never stores a
    replicated chunk twice, so a tensor claiming more elements than its stored bytes hold is a
    forged or damaged ``.metadata``: caught here, before anything sizes a buffer from the claim.
    Tensors stored through a stream transform (compression) have no floor and are not checked."""
    itemsize = _ITEMSIZE.get(dtype.removeprefix("torch."))
    if itemsize is None or transformed:
        return ""
    numel = 1
    for d in size:
        numel *= d
    if numel < 0 or any(d < 0 for d in size):
        return f"tensor {name!r} has a negative dimension {list(size)} in {METADATA_FILE}"
    need = numel * itemsize
    if need > (stored or 0):
        return (f"tensor {name!r} claims shape {list(size)} ({dtype}, {human_bytes(need)}) but {METADATA_FILE} "
                f"stores {human_bytes(stored or 0)} for it")
    return ""


MAX_OBJECT_BYTES = 16 << 20       # one non-tensor entry (a pickled param-group value is ~1 KiB)
MAX_OBJECTS_TOTAL = 256 << 20     # all of them together


def read_object_values(root: Path, c: DcpContents, *, display: Optional[str] = None) -> dict[str, object]:
    """The values of a DCP directory's non-tensor entries (optimizer param-group values...),
    read from the data files through the restricted unpickler: a value that would run code
    is refused (UnsafePickleError) here, before anything else reads it. Entries stored with
    a stream transform (compression) are skipped: their bytes are not a pickle."""
    from engine.checkpoint.io.files import require_regular_file
    from engine.checkpoint.io.safe_unpickle import PickleTooLargeError, read_torch_archive_bytes

    shown = display or str(root)
    out: dict[str, object] = {}
    total = 0
    by_file: dict[str, list[tuple[str, int, int]]] = {}
    for name, (rel, off, length, transformed) in c.object_locations.items():
        if not transformed:
            by_file.setdefault(rel, []).append((name, off, length))
    for rel, items in sorted(by_file.items()):
        path = root / rel
        require_regular_file(path, f"{shown}/{rel}")
        with open(path, "rb") as f:
            for name, off, length in sorted(items, key=lambda x: x[1]):
                total += length
                if length > MAX_OBJECT_BYTES or total > MAX_OBJECTS_TOTAL:
                    raise PickleTooLargeError(
                        f"{shown}: entry {name!r} is {length:,} bytes ({total:,} with those before it); rl "
                        f"reads non-tensor entries of at most {MAX_OBJECT_BYTES:,} bytes, "
                        f"{MAX_OBJECTS_TOTAL:,} in all.", title="checkpoint too large")
                f.seek(off)
                data = f.read(length)
                if len(data) != length:
                    raise CheckpointError(f"{shown}/{rel} is truncated: entry {name!r} ends at byte "
                                          f"{off + length:,}.", title="corrupt checkpoint")
                archive = read_torch_archive_bytes(data, display=f"{shown}/{rel} (entry {name})")
                out[name] = archive.obj
    return out


def raise_problems(shown: str, problems: list[str]) -> None:
    """Data-file problems make a checkpoint unusable: one clear error listing them all."""
    if problems:
        raise CheckpointError(
            f"{shown} is truncated or incomplete: " + "; ".join(problems) + ". Copy the "
            "checkpoint again from where it was written, or pick another one.",
            title="corrupt checkpoint")
