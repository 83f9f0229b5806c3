"""Redirect megatron-core's few hard CUDA assumptions to the CPU, when there is no CUDA.

megatron-core 0.16 builds and trains a ``GPTModel`` over gloo on a CPU-only torch once a
handful of ``torch.cuda`` calls stop insisting on a GPU. This module is the one place that
does that. What it replaces (nothing else), and by what:

=================================================  ===========================================
``torch.cuda.current_device()``                    ``torch.device("cpu")`` (megatron only uses
                                                   it as ``device=...`` for new tensors)
``torch.Tensor.cuda`` / ``torch.nn.Module.cuda``   identity (the tensor/module stays on CPU)
``torch.cuda.synchronize``                         no-op (CPU ops are synchronous)
``torch.cuda.get_rng_state`` / ``set_rng_state``   the CPU default generator's state
``torch.cuda.manual_seed``                         seeds the CPU default generator
``megatron.core.tensor_parallel.random.``          the same, so megatron's RNG tracker
``_get_cuda_rng_state`` / ``_set_cuda_rng_state``  (``get_cuda_rng_tracker().fork()``) forks the
                                                   CPU generator, which is what CPU ops draw from
=================================================  ===========================================

``apply()`` does nothing when ``torch.cuda.is_available()`` (on a GPU megatron-core runs
unpatched). It is idempotent; ``remove()`` puts every original back (tests use it).
``PATCHES`` lists the (module, attribute) pairs so that a test can check that megatron-core
and torch still have them: if a megatron-core release moves a CUDA use elsewhere, that test
and the CPU forward test fail rather than this module silently patching nothing.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

# (importable module path, attribute name): the exact things this shim replaces.
PATCHES: tuple[tuple[str, str], ...] = (
    ("torch.cuda", "current_device"),
    ("torch.cuda", "synchronize"),
    ("torch.cuda", "get_rng_state"),
    ("torch.cuda", "set_rng_state"),
    ("torch.cuda", "manual_seed"),
    ("torch.cuda.random", "get_rng_state"),
    ("torch.cuda.random", "set_rng_state"),
    ("torch.cuda.random", "manual_seed"),
    ("torch", "Tensor.cuda"),
    ("torch.nn", "Module.cuda"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
)

_MISSING = object()
# (owner object, attribute) -> the value that owner held in its own __dict__ (or _MISSING)
_saved: dict[tuple[object, str], object] = {}


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_synchronize(device=None) -> None:
    return None


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device="cuda", graph_safe: bool = False) -> None:
    torch.default_generator.set_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _tensor_cuda(self, device=None, non_blocking: bool = False, memory_format=None):
    return self


def _module_cuda(self, device=None):
    return self


_REPLACEMENTS: dict[tuple[str, str], Callable] = {
    ("torch.cuda", "current_device"): _cpu_current_device,
    ("torch.cuda", "synchronize"): _cpu_synchronize,
    ("torch.cuda", "get_rng_state"): _cpu_get_rng_state,
    ("torch.cuda", "set_rng_state"): _cpu_set_rng_state,
    ("torch.cuda", "manual_seed"): _cpu_manual_seed,
    ("torch.cuda.random", "get_rng_state"): _cpu_get_rng_state,
    ("torch.cuda.random", "set_rng_state"): _cpu_set_rng_state,
    ("torch.cuda.random", "manual_seed"): _cpu_manual_seed,
    ("torch", "Tensor.cuda"): _tensor_cuda,
    ("torch.nn", "Module.cuda"): _module_cuda,
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): _cpu_get_rng_state,
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): _cpu_set_rng_state,
}


def _owner_and_name(module_path: str, attr: str) -> tuple[object, str]:
    """The object that holds ``attr`` (a module, or a class for "Class.method")."""
    owner: object = importlib.import_module(module_path)
    *parents, name = attr.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner, name


def needed() -> bool:
    """True when this process has no usable CUDA device (the shim's only use case)."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return bool(_saved)


def apply() -> bool:
    """Install the CPU redirections if CUDA is absent. Returns whether they are in place."""
    if not needed():
        return False
    if _saved:
        return True
    for key in PATCHES:
        owner, name = _owner_and_name(*key)
        if not hasattr(owner, name):
            raise RuntimeError(
                f"megatron CPU shim: {key[0]}.{key[1]} no longer exists; this megatron-core/torch "
                "pair is untested with the CPU backend (pin megatron-core>=0.16.1,<0.17)")
        _saved[(owner, name)] = vars(owner).get(name, _MISSING)
    for key in PATCHES:
        owner, name = _owner_and_name(*key)
        setattr(owner, name, _REPLACEMENTS[key])
    return True


def remove() -> None:
    """Undo ``apply()`` exactly (attributes that were inherited are deleted again)."""
    for (owner, name), original in list(_saved.items()):
        if original is _MISSING:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, original)
    _saved.clear()
