"""Content hashes of checkpoint files, computed while the bytes are written (never by re-reading).

Every file of a checkpoint gets a content digest: XXH3-128 from the ``xxhash`` package (a core
dependency; ~12x faster than a cryptographic hash, which matters for checkpoints of hundreds of
GB: hashing while writing costs ~1.03x a plain save, BLAKE2b ~4x), or BLAKE2b-256 (``hashlib``,
always available) where ``xxhash`` cannot be imported. The
manifest records which; verifying an XXH3 checkpoint without ``xxhash`` is a clear error. The
digests detect corruption, not forgery: anyone who can edit the files can recompute them
(docs/security.md).

- DCP's shards and ``.metadata`` go through :class:`HashingWriter`, a ``FileSystemWriter``
  whose file system wraps each output stream in :class:`HashingStream` (DCP writes each file
  sequentially: ``write`` and ``tell`` only), so the digest is updated as DCP writes;
- the small files (``rng/rank_R.pt``, ``trainer.json``) are serialised to bytes first, hashed,
  then written atomically (:func:`write_bytes_atomic`).

The manifest records ``{"algorithm": "xxh3-128" | "blake2b-256", "files": {rel: hex}}`` and, over everything
else it holds, its own digest (:func:`manifest_digest`), so an edited manifest is detected too.
Verification (:mod:`engine.checkpoint.verify`) re-reads the files once, with the same hash.
"""

from __future__ import annotations

import hashlib
import io
import json

from engine import json_safe
import os
import threading
from contextlib import contextmanager
from pathlib import Path

BLAKE2B = "blake2b-256"
XXH3 = "xxh3-128"
ALGORITHMS = (XXH3, BLAKE2B)
MANIFEST_DIGEST_KEY = "manifest_digest"   # always BLAKE2b: the manifest is small
_CHUNK = 4 << 20


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return BLAKE2B
    return XXH3


def new_hash(algorithm: str = BLAKE2B):
    from engine.errors import CheckpointError

    if algorithm == BLAKE2B:
        return hashlib.blake2b(digest_size=32)
    if algorithm == XXH3:
        try:
            import xxhash
        except ImportError:
            raise CheckpointError(f"this checkpoint's files were hashed with {XXH3}, which needs the xxhash package: "
                                  f"pip install xxhash (a dependency of rl; or skip content hashes with --no-verify).",
                                  title="missing package") from None
        return xxhash.xxh3_128()
    raise CheckpointError(f"unknown content hash algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)}); the "
                          f"manifest is damaged or from a newer rl.", title="unsupported checkpoint")


def hash_bytes(data: bytes | bytearray | memoryview, algorithm: str = BLAKE2B) -> str:
    h = new_hash(algorithm)
    h.update(data)
    return h.hexdigest()


def hash_file(path: Path, algorithm: str = BLAKE2B) -> tuple[int, str]:
    """(bytes, digest) of a regular file, read in 4 MiB chunks."""
    h = new_hash(algorithm)
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            k = f.readinto(buf)
            if not k:
                break
            h.update(view[:k])
            n += k
    return n, h.hexdigest()


def canonical_json(obj) -> bytes:
    """The bytes a manifest's digest is computed over (key order and spacing do not matter)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str,
                      allow_nan=True).encode()


def manifest_digest(manifest: dict) -> str:
    """Digest of every manifest field except the digest itself."""
    return hash_bytes(canonical_json({k: v for k, v in manifest.items() if k != MANIFEST_DIGEST_KEY}))


def seal_manifest(manifest: dict) -> dict:
    """``manifest`` plus its own digest (the JSON round trip makes the digest match what is read back)."""
    plain = json_safe.loads(json.dumps(manifest, default=str))
    plain.pop(MANIFEST_DIGEST_KEY, None)
    plain[MANIFEST_DIGEST_KEY] = manifest_digest(plain)
    return plain


def write_bytes_atomic(path: Path, data: bytes, algorithm: str = BLAKE2B) -> str:
    """Write ``data`` to ``path`` via temp + fsync + rename; returns its digest."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hash_bytes(data, algorithm)


def json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=2, default=str).encode()


class HashingStream(io.RawIOBase):
    """A write-only stream that hashes what passes through to ``raw``."""

    def __init__(self, raw, algorithm: str):
        super().__init__()
        self.raw = raw
        self.hash = new_hash(algorithm)
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        n = len(view) if n is None else n
        self.hash.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def seekable(self) -> bool:
        return False  # a seek would make the running digest wrong: DCP never seeks on write

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()
            self.raw.close()
        super().close()


def _dcp_file_system_class():
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        """DCP's local file system, recording (size, digest) of every file it writes."""

        def __init__(self, algorithm: str) -> None:
            super().__init__()
            self.algorithm = algorithm
            self.digests: dict[str, tuple[int, str]] = {}
            self._lock = threading.Lock()

        @contextmanager
        def create_stream(self, path, mode: str):
            if "w" not in mode and "a" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as raw:
                stream = HashingStream(raw, self.algorithm)
                yield stream
                stream.close()
            with self._lock:
                self.digests[str(Path(path))] = (stream.size, stream.hash.hexdigest())

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            with self._lock:
                d = self.digests.pop(str(Path(path)), None)
                if d is not None:
                    self.digests[str(Path(new_path))] = d

    return HashingFileSystem


def hashing_writer(path: Path, algorithm: str | None = None):
    """A DCP ``FileSystemWriter`` for ``path`` that hashes while writing; after ``dcp.save``,
    ``writer.fs.digests`` maps each written file's path to (bytes, digest) and
    ``writer.fs.algorithm`` names the hash."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(path))
    writer.fs = _dcp_file_system_class()(algorithm or default_algorithm())
    return writer
