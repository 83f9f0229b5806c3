"""What a checkpoint's metadata records about its entries and files, as the safe readers return
them: never tensor values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Order in which groups are listed; names a reader may assign to an entry.
GROUPS = ("model", "optimizer state", "optimizer param groups", "critic model", "critic optimizer state",
          "critic optimizer param groups", "rng", "scheduler", "data", "other")


@dataclass
class TensorInfo:
    """One tensor as recorded in metadata: never its values.

    ``shape`` is the full (global) shape; ``shards`` counts the pieces stored for it
    (DCP chunks, per-rank files). ``nbytes`` is elements x element size of the full tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shards: int = 1
    placement: str = ""  # e.g. "Shard(0) x2 ranks" for DTensors; empty when stored whole
    group: str = "other"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        from engine.checkpoint.io.dtypes import tensor_nbytes

        return tensor_nbytes(self.dtype, self.numel)

    def to_json(self) -> dict:
        return {"name": self.name, "group": self.group, "dtype": self.dtype,
                "shape": list(self.shape), "elements": self.numel, "bytes": self.nbytes,
                "shards": self.shards, "placement": self.placement}


@dataclass
class ObjectInfo:
    """A non-tensor entry (a Python value pickled into the checkpoint, a JSON field)."""

    name: str
    type: str  # "bytes" for DCP byte entries whose value is not read, else a Python type name
    group: str = "other"
    stored_bytes: Optional[int] = None  # bytes it occupies on disk when the format says
    preview: str = ""  # short repr for scalars/strings read from metadata

    def to_json(self) -> dict:
        return {"name": self.name, "group": self.group, "type": self.type,
                "stored_bytes": self.stored_bytes, "preview": self.preview}


@dataclass
class FileInfo:
    """A file of the checkpoint and its size on disk."""

    path: str  # relative to the checkpoint directory (or the file name for a single file)
    bytes: int

    def to_json(self) -> dict:
        return {"path": self.path, "bytes": self.bytes}
