"""Keep the host memory a step frees for the next step (glibc malloc tuning of a rank).

A training step on a CPU allocates and frees the same activations every step (~175 MB at the
issue-17 shape: 3.4M parameters, 64 rows x 56 tokens). glibc's defaults give much of it back:
blocks above its dynamic mmap threshold are mmap'd and unmapped one by one, and free memory at the
top of the heap is trimmed once it passes the trim threshold. The next step then page-faults every
page in again, zero-filled by the kernel: ~45,000 minor faults an update here, ~0.1 s of system
time and cold caches (docs/benchmarks.md, issue 17). With a fixed mmap threshold at glibc's
maximum (32 MiB) and a trim threshold of 1 GiB the heap keeps those pages: 0 faults a step.

The cost: a rank's resident memory stays at its own peak between steps instead of dipping (it
returns there every step anyway). Tensors of 32 MiB and more are still mapped and unmapped
directly. CUDA and pinned host memory are not malloc's and are unaffected. The numbers a step
computes do not depend on it. ``trainer.keep_host_heap=false`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30


def keep_host_heap() -> str:
    """Tune this process's glibc malloc to keep freed memory for reuse. Returns '' when applied,
    else a one-line reason (not Linux/glibc, or mallopt refused)."""
    if not sys.platform.startswith("linux"):
        return f"not tuned: {sys.platform} has no glibc malloc"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not tuned: the C library is not glibc"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "not tuned: glibc's mallopt refused the thresholds"
    return ""


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): byte counts over every arena, as size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_usage() -> tuple[int, int] | None:
    """(in use, freed but held) bytes of this process's glibc malloc, over all arenas and its
    direct mmaps; None where there is no glibc ``mallinfo2``.

    The two tell a leak from a high-water mark: memory a program still references is "in use";
    memory it freed that malloc keeps (``keep_host_heap``, fragmentation between live blocks) is
    "held". RSS counts both (and whatever is not malloc's: the interpreter, mapped libraries)."""
    global _mallinfo2
    if _mallinfo2 is None:
        _mallinfo2 = _load_mallinfo2()
    if not _mallinfo2:
        return None
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


_mallinfo2 = None  # resolved on first use; False where unavailable


def _load_mallinfo2():
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return False
    fn.argtypes, fn.restype = [], _Mallinfo2
    return fn


# oneDNN's kernels (engine.cpu_matmul=onednn, auto on AMD CPUs) are cached per product shape in two
# LRU caches: oneDNN's primitive cache and PyTorch's ideep cache (1,024 entries each by default).
# With ragged batches every new (rows, length) adds entries holding packed buffers: the default
# job's rank held +360 MiB more than with MKL after 800 steps, still growing at new shapes. 256
# entries hold several steps' worth of shapes (a step makes ~30-60).
KERNEL_CACHE_CAPACITY = 256
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def kernel_cache_env() -> dict[str, str]:
    """Environment bounding a rank's oneDNN/ideep kernel caches (read once, at their first use):
    the user's own values where set, else ``KERNEL_CACHE_CAPACITY``."""
    import os

    return {k: os.environ.get(k, str(KERNEL_CACHE_CAPACITY)) for k in KERNEL_CACHE_ENV}
