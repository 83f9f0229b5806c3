"""Move parameters and optimizer state between device and host memory, for any backend.

Both engines (FSDP2 and Megatron) call these between phases when ``engine.param_offload`` /
``engine.optimizer_offload`` are set:

    report = offload_params(model)               # params -> host, grads released, FP8 cleared
    report = onload_params(model, device)        # params back, grads re-allocated if bucketed
    report = offload_optimizer_state(optimizer)  # every optimizer state tensor -> host
    report = onload_optimizer_state(optimizer, device)

How: the memory is moved per *storage*, not per tensor. Each distinct storage behind the
parameters (for a DTensor, behind its local shard) is copied into a host buffer and then
resized to 0 bytes; onload resizes it back and copies the bytes in. Tensor objects, their
views (megatron-core's contiguous param/grad buffers, FSDP2's padded shard, tied weights) and
the optimizer's references to them all stay valid, and the round trip is bit-exact. While
offloaded the tensors have no memory: onload before any forward, checkpoint or export.

Host buffers are pinned when the storage is on CUDA, and kept and reused by the next offload
of the same storage, so repeated offloads neither re-pin memory (slow) nor hold two host
copies at once.

On a CPU-only run parameters already live in host memory: the helpers move nothing and say so
in the report's ``note``, but parameter offload still clears FP8 workspaces and counts them.
``simulate_on_cpu=True`` runs the real move logic on CPU storages (a separate host buffer is
the "host"), so the bookkeeping can be tested without a GPU.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from engine.memory.fp8_workspaces import clear_fp8_workspaces, iter_modules, storage_key, tensors_in


@dataclass
class OffloadReport:
    """What an offload or onload moved, and what it freed."""

    param_bytes: int = 0
    grad_bytes_released: int = 0
    optimizer_bytes: int = 0
    fp8_workspaces_cleared: int = 0
    fp8_workspace_bytes_freed: int = 0
    note: str = ""


CPU_NOOP_NOTE = "offload is a no-op on CPU: params already live in host memory"


@dataclass
class _MovedStorage:
    storage: torch.UntypedStorage
    full: torch.Tensor          # uint8 view over the whole storage, to copy back into
    nbytes: int
    device: torch.device


@dataclass
class _OffloadState:
    """What one model (or optimizer) has on host now, and the host buffers kept for reuse."""

    kind: str
    host_buffers: dict = field(default_factory=dict)     # storage id -> uint8 host tensor
    moved: list = field(default_factory=list)            # [_MovedStorage] currently offloaded
    released_grads: list = field(default_factory=list)   # [_MovedStorage] bucketed grads resized to 0

    def host_buffer_bytes(self) -> int:
        return sum(int(b.numel()) for b in self.host_buffers.values())

    def offloaded_bytes(self) -> int:
        return sum(m.nbytes for m in self.moved)


_STATES: "weakref.WeakKeyDictionary[object, _OffloadState]" = weakref.WeakKeyDictionary()


def _state_for(owner, kind: str) -> _OffloadState:
    st = _STATES.get(owner)
    if st is None:
        st = _OffloadState(kind)
        _STATES[owner] = st
    return st


def host_memory_held() -> dict[str, dict[str, int]]:
    """Host bytes held by these helpers in this process, by kind ("params", "optimizer"):
    ``buffers`` (allocated host buffers, kept for reuse) and ``offloaded`` (holding data now)."""
    out: dict[str, dict[str, int]] = {}
    for st in list(_STATES.values()):
        d = out.setdefault(st.kind, {"buffers": 0, "offloaded": 0})
        d["buffers"] += st.host_buffer_bytes()
        d["offloaded"] += st.offloaded_bytes()
    return out


# ---- what to move -------------------------------------------------------------------------
def _distinct_storages(tensors, include_cpu: bool):
    """(storage, device) for each distinct non-empty storage behind ``tensors``."""
    seen, out = set(), []
    for t in tensors:
        if t.device.type == "meta":
            continue
        if t.device.type == "cpu" and not include_cpu:
            continue
        k = storage_key(t)
        if k in seen:
            continue
        seen.add(k)
        st = t.untyped_storage()
        if st.nbytes() == 0:          # already offloaded (or an empty shard)
            continue
        out.append((st, t.device))
    return out


def _param_tensors(module):
    seen = set()
    for m in iter_modules(module):
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron-core wrappers (ChainedOptimizer, mixed precision)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in _torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return _torch_optimizers(inner) if inner is not None else []


def _master_param_groups(optimizer) -> list:
    """fp32 master copies megatron-core's mixed-precision optimizers keep beside the model."""
    out = []
    chained = getattr(optimizer, "chained_optimizers", None)
    for opt in (chained if chained is not None else [optimizer]):
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            groups = getattr(opt, attr, None)
            if groups:
                out.extend(t for g in groups for t in g if isinstance(t, torch.Tensor))
    return out


def optimizer_state_tensors(optimizer):
    """Every plain tensor the optimizer holds as state (DTensor state -> its local shard),
    plus megatron-core's fp32 master params."""
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            yield from tensors_in(state)
    yield from tensors_in(_master_param_groups(optimizer))


# ---- moving storages ----------------------------------------------------------------------
def _uint8_view(st: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    n = st.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (n,), (1,))


def _host_buffer(state: _OffloadState, st: torch.UntypedStorage, nbytes: int, device) -> tuple[torch.Tensor, bool]:
    key = st._cdata
    buf = state.host_buffers.get(key)
    if buf is not None and buf.numel() == nbytes:
        return buf, True
    pin = device.type == "cuda"
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
    state.host_buffers[key] = buf
    return buf, False


def _sync(devices) -> None:
    for d in {str(d) for d in devices}:
        dev = torch.device(d)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def _move_out(state: _OffloadState, storages) -> tuple[int, int, list]:
    """Copy each storage to its host buffer, then free it. Returns (bytes, reused, devices)."""
    if not state.moved:       # drop buffers of storages that no longer exist (e.g. state reloaded)
        live = {st._cdata for st, _ in storages}
        for key in [k for k in state.host_buffers if k not in live]:
            del state.host_buffers[key]
    moved, reused, copies = 0, 0, []
    for st, dev in storages:
        full = _uint8_view(st, dev)
        nbytes = int(full.numel())
        host, was_reused = _host_buffer(state, st, nbytes, dev)
        reused += int(was_reused)
        host.copy_(full, non_blocking=dev.type == "cuda")
        copies.append(_MovedStorage(st, full, nbytes, dev))
    _sync(m.device for m in copies)
    for m in copies:
        m.storage.resize_(0)
        moved += m.nbytes
    state.moved.extend(copies)
    return moved, reused, [m.device for m in copies]


def _move_in(state: _OffloadState, device: torch.device | None) -> tuple[int, list]:
    moved = 0
    for m in state.moved:
        if device is not None and device.type != "cpu" and m.device.type != device.type:
            raise ValueError(f"onload to {device}, but this memory was offloaded from {m.device}")
        m.storage.resize_(m.nbytes)
        host = state.host_buffers[m.storage._cdata]
        m.full.copy_(host, non_blocking=m.device.type == "cuda")
        moved += m.nbytes
    devices = [m.device for m in state.moved]
    _sync(devices)
    state.moved.clear()
    return moved, devices


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _where(devices, pinned: bool) -> str:
    src = ",".join(sorted({str(d) for d in devices})) or "-"
    return f"{src} -> {'pinned ' if pinned else ''}host"


def _empty_cache(devices) -> None:
    if any(torch.device(d).type == "cuda" for d in {str(d) for d in devices}):
        torch.cuda.empty_cache()


# ---- parameters ---------------------------------------------------------------------------
def _reshard_fsdp(module) -> None:
    """Free FSDP2 all-gathered (unsharded) params so only the shards remain to move."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for m in iter_modules(module):
        if isinstance(m, FSDPModule):
            m.reshard()


def _release_grads(module, state: _OffloadState, include_cpu: bool) -> int:
    """Drop ``.grad`` of every param; free bucketed ``main_grad`` storage (megatron-core).
    Returns bytes released."""
    seen, released = set(), 0
    for p in _param_tensors(module):
        g = p.grad
        if g is not None and (include_cpu or g.device.type != "cpu"):
            for t in tensors_in(g):
                k = storage_key(t)
                if k not in seen:
                    seen.add(k)
                    released += int(t.untyped_storage().nbytes())
            p.grad = None
        mg = getattr(p, "main_grad", None)
        if isinstance(mg, torch.Tensor) and (include_cpu or mg.device.type != "cpu"):
            k = storage_key(mg)
            st = mg.untyped_storage()
            if k not in seen and st.nbytes() > 0:
                seen.add(k)
                full = _uint8_view(st, mg.device)
                state.released_grads.append(_MovedStorage(st, full, int(full.numel()), mg.device))
                released += int(full.numel())
                st.resize_(0)
    return released


def offload_params(module, *, simulate_on_cpu: bool = False, clear_fp8: bool = True) -> OffloadReport:
    """Move ``module``'s parameters to host, release gradients, clear FP8 workspaces.

    ``module`` may be a model, a wrapper (FSDP2, DDP, megatron-core) or a list of model chunks.
    ``clear_fp8=False`` leaves TE's workspaces on the device (only to measure what clearing
    saves, as bench/gpu_check.sh does; engines always clear).
    """
    if isinstance(module, (list, tuple)):       # megatron model chunks: one state per chunk
        return combine_reports(*(offload_params(m, simulate_on_cpu=simulate_on_cpu, clear_fp8=clear_fp8)
                                 for m in module))
    n_ws, ws_bytes = clear_fp8_workspaces(module) if clear_fp8 else (0, 0)
    # reshard first: a forward without backward (reshard_after_forward=False) leaves FSDP2 units
    # unsharded, their unsharded parameters registered, which resharding frees: the sharded ones
    # are what must move
    _reshard_fsdp(module)
    params = list(_param_tensors(module))
    on_device = any(t.device.type not in ("cpu", "meta") for p in params for t in tensors_in(p))
    fp8_note = f"; FP8 workspaces cleared: {n_ws} ({_fmt(ws_bytes)})" if n_ws else ""
    if not on_device and not simulate_on_cpu:
        return OffloadReport(fp8_workspaces_cleared=n_ws, fp8_workspace_bytes_freed=ws_bytes,
                             note=CPU_NOOP_NOTE + fp8_note)
    state = _state_for(module, "params")
    grad_bytes = _release_grads(module, state, include_cpu=simulate_on_cpu)
    storages = _distinct_storages((t for p in params for t in tensors_in(p)), include_cpu=simulate_on_cpu)
    moved, reused, devices = _move_out(state, storages)
    _empty_cache(devices)
    pinned = any(d.type == "cuda" for d in devices)
    note = (f"params: {len(storages)} storages, {_fmt(moved)} {_where(devices, pinned)} "
            f"({reused} host buffers reused); grads released: {_fmt(grad_bytes)}{fp8_note}")
    return OffloadReport(param_bytes=moved, grad_bytes_released=grad_bytes, fp8_workspaces_cleared=n_ws,
                         fp8_workspace_bytes_freed=ws_bytes, note=note)


def onload_params(module, device: torch.device | str | None = None) -> OffloadReport:
    """Bring back what ``offload_params(module)`` moved; re-allocate (zeroed) bucketed grads."""
    if isinstance(module, (list, tuple)):
        return combine_reports(*(onload_params(m, device) for m in module))
    device = torch.device(device) if device is not None else None
    state = _STATES.get(module)
    if state is None or (not state.moved and not state.released_grads):
        if device is None or device.type == "cpu":
            return OffloadReport(note=CPU_NOOP_NOTE)
        return OffloadReport(note="nothing to onload: params were not offloaded")
    moved, devices = _move_in(state, device)
    grad_bytes = 0
    for g in state.released_grads:
        g.storage.resize_(g.nbytes)
        g.full.zero_()
        grad_bytes += g.nbytes
    state.released_grads.clear()
    note = f"params: {_fmt(moved)} host -> {','.join(sorted({str(d) for d in devices})) or '-'}"
    if grad_bytes:
        note += f"; grad buffers re-allocated: {_fmt(grad_bytes)}"
    return OffloadReport(param_bytes=moved, note=note)


# ---- optimizer state ----------------------------------------------------------------------
def offload_optimizer_state(optimizer, *, simulate_on_cpu: bool = False) -> OffloadReport:
    """Move every optimizer state tensor (Adam moments, step, megatron fp32 masters) to host."""
    tensors = list(optimizer_state_tensors(optimizer))
    if not any(t.device.type not in ("cpu", "meta") for t in tensors) and not simulate_on_cpu:
        return OffloadReport(note=CPU_NOOP_NOTE.replace("params", "optimizer state"))
    state = _state_for(optimizer, "optimizer")
    storages = _distinct_storages(tensors, include_cpu=simulate_on_cpu)
    moved, reused, devices = _move_out(state, storages)
    _empty_cache(devices)
    pinned = any(d.type == "cuda" for d in devices)
    note = (f"optimizer: {len(storages)} storages, {_fmt(moved)} {_where(devices, pinned)} "
            f"({reused} host buffers reused)")
    return OffloadReport(optimizer_bytes=moved, note=note)


def onload_optimizer_state(optimizer, device: torch.device | str | None = None) -> OffloadReport:
    """Bring back what ``offload_optimizer_state(optimizer)`` moved."""
    device = torch.device(device) if device is not None else None
    state = _STATES.get(optimizer)
    if state is None or not state.moved:
        if device is None or device.type == "cpu":
            return OffloadReport(note=CPU_NOOP_NOTE.replace("params", "optimizer state"))
        return OffloadReport(note="nothing to onload: optimizer state was not offloaded")
    moved, devices = _move_in(state, device)
    return OffloadReport(optimizer_bytes=moved,
                         note=f"optimizer: {_fmt(moved)} host -> {','.join(sorted({str(d) for d in devices}))}")


def combine_reports(*reports: OffloadReport) -> OffloadReport:
    """One report for an engine-level offload/onload made of several helper calls."""
    out = OffloadReport()
    for r in reports:
        out.param_bytes += r.param_bytes
        out.grad_bytes_released += r.grad_bytes_released
        out.optimizer_bytes += r.optimizer_bytes
        out.fp8_workspaces_cleared += r.fp8_workspaces_cleared
        out.fp8_workspace_bytes_freed += r.fp8_workspace_bytes_freed
    notes = [r.note for r in reports if r.note]
    out.note = "; ".join(dict.fromkeys(notes))
    return out


def release_host_buffers(owner) -> int:
    """Drop the host buffers kept for ``owner`` (a model or optimizer) once nothing is
    offloaded; returns bytes released. Use at shutdown or when offload is turned off."""
    state = _STATES.get(owner)
    if state is None or state.moved:
        return 0
    n = state.host_buffer_bytes()
    state.host_buffers.clear()
    return n
