"""Loading DCP state without ever running code from the checkpoint (rank side of `rl resume`).

torch.distributed.checkpoint unpickles twice with the full pickle machinery:
``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``, and
``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)`` on every non-tensor
entry (our optimizer param-group values). A crafted shard can make either call any function
(``os.system``). Here:

- :func:`safe_reader` reads ``.metadata`` with an unpickler that resolves only the dataclasses
  DCP's metadata is made of (and torch dtypes, ``torch.Size``); anything else is refused;
- :class:`SafeLoadPlanner` unpickles non-tensor entries with ``torch.load(weights_only=True)``
  (plain containers and scalars, tensors); anything else is refused;
- tensors are already read by DCP with ``weights_only=True``.

A refusal is a :class:`~engine.errors.CheckpointError` (exit 2). The driver has, before any
rank starts, already read the same bytes through the inspector's restricted unpickler
(engine/checkpoint/io/safe_unpickle.py), so this is the second of two independent guards.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

from engine.errors import CheckpointError

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self._source} refers to `{module}.{name}`, which DCP metadata never holds; refused without "
            f"running it. The checkpoint may be crafted to run code when loaded.", title="unsafe checkpoint")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self._source} holds an external reference; DCP metadata never does. Refused.",
                              title="unsafe checkpoint")


def safe_reader(path: Path):
    """A DCP ``FileSystemReader`` for ``path`` whose ``.metadata`` goes through the allow-list
    unpickler above instead of ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md_path = self._get_metadata_path(kwargs.get("rank"))
            shown = str(md_path)
            with self.fs.create_stream(md_path, "rb") as f:
                data = f.read()
            try:
                metadata = _MetadataUnpickler(io.BytesIO(data), shown).load()
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{shown} cannot be read as DCP metadata ({type(e).__name__}: "
                                      f"{str(e)[:200]}); the checkpoint is damaged.",
                                      title="corrupt checkpoint") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def load_bytes_safely(value: io.BytesIO, fqn: str):
    import torch

    try:
        return torch.load(value, weights_only=True)
    except Exception as e:  # torch's UnpicklingError names the global it refused
        raise CheckpointError(
            f"checkpoint entry {fqn!r} is not plain data ({type(e).__name__}: {str(e)[:300]}). rl loads non-tensor "
            f"checkpoint values only as containers, numbers and strings; this one needs more (it may be crafted "
            f"to run code), so it was refused without running it.", title="unsafe checkpoint") from None


def _make_safe_planner():
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor values are unpickled with weights_only=True."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = load_bytes_safely(value, fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner


def __getattr__(name: str):
    if name == "SafeLoadPlanner":
        cls = _make_safe_planner()
        globals()["SafeLoadPlanner"] = cls
        return cls
    raise AttributeError(name)
