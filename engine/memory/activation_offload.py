"""Activation offload: tensors that chosen modules save for backward go to host during forward
and come back for backward, the copies overlapped with compute.

    off = ActivationOffloader(model, ["model.layers.*"], host_limit_bytes=8 << 30, device=dev)
    off.attach()                 # hooks on every matching module (outermost matches only)
    loss = model(...).loss       # forward: saved tensors of matching modules -> pinned host buffers
    loss.backward()              # backward: each module prefetches the one that ran before it
    off.end_micro_batch()        # host buffers go back to the pool for the next micro-batch
    off.stats                    # bytes offloaded / kept on device (over the host limit)

How. While a matching module runs forward, ``torch.autograd.graph.saved_tensors_hooks`` is
active for it: ``pack`` copies each saved activation into a host buffer (pinned, from a pool
reused across micro-batches and steps) on a side CUDA stream and records an event; ``unpack``
waits for the matching prefetch, or copies back on the spot. When a module's backward starts
(a full backward pre-hook), the saved tensors of the module that ran just before it in forward
are copied back on the side stream, so the next module's backward finds them ready (and within
a module, unpacking a tensor prefetches the one saved before it: a module matched alone, such as
megatron's whole decoder under full recompute, has no module before it); events
make sure compute never reads a copy in flight and the caching allocator never reuses a
source that is still being copied (``record_stream``).
A tensor several ops save (a layer's normed input, read by the q, k and v projections, or by the
gate and up projections) is copied once and restored once. The offloader lets go of a restored
copy when its last reader unpacks it: autograd then frees it when that node has run, so backward
holds the restored activations of the modules it is in, not of every module it has passed.

What is not offloaded: parameters (and views of them: matmuls save weights, which offload
would only duplicate); tensors saved outside matching modules; tensors saved while backward
runs (a recompute); and, once the pool holds ``host_limit_bytes``, any further tensor, which
stays on the device and is counted in ``stats.kept_bytes``.

Gradient checkpointing. A checkpointed layer keeps only its inputs; everything inside is
recomputed. Transformers checkpoints a layer's ``forward`` inside the module call, so this
module's hooks surround the checkpoint. In reentrant mode the checkpoint saves its inputs with
``ctx.save_for_backward``, which goes through these hooks: exactly what checkpointing keeps is
offloaded. ``use_reentrant_checkpointing(model)`` switches a transformers model to that mode
(gradients are identical; the engines call it when both features are on).

On a CPU the same code runs; host and device are one memory, so nothing is saved, but the
copies, the pool, the limit and the prefetch order are exercised, and gradients must be
bit-identical with and without offload (tests/test_activation_offload.py).
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass, field

import torch

GiB = 1 << 30


@dataclass
class OffloadStats:
    """Per micro-batch counts (reset by ``end_micro_batch``) and peaks across the run."""

    host_bytes: int = 0           # bytes of saved tensors copied to host in this micro-batch
    kept_bytes: int = 0           # bytes kept on the device because the host pool was full
    tensors_offloaded: int = 0
    tensors_kept: int = 0
    prefetched: int = 0           # tensors brought back ahead of use by the backward prefetch
    fetched_on_demand: int = 0    # tensors copied back when backward asked (not prefetched)
    pool_bytes: int = 0           # host buffers allocated so far (<= the limit)
    peak_host_bytes: int = 0
    modules: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "modules"} | {"modules": len(self.modules)}


def matching_modules(model: torch.nn.Module, patterns: list[str]) -> list[tuple[str, torch.nn.Module]]:
    """Modules whose qualified name matches any glob pattern, outermost matches only (a match
    inside a matched module is covered by it), in registration order."""
    out: list[tuple[str, torch.nn.Module]] = []
    for name, mod in model.named_modules():
        if not name or not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        if any(name.startswith(prev + ".") for prev, _ in out):
            continue
        out.append((name, mod))
    return out


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter)


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill exactly numel consecutive slots in some order (a permutation of a
    contiguous layout): a buffer of numel elements can hold it with the same strides."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _HostPool:
    """Host buffers by (dtype, numel), reused; never more than ``limit`` bytes allocated. A buffer
    of a new size that would pass the limit first evicts free buffers of other sizes (micro-batch
    shapes vary: without it, the first shapes' buffers would fill the limit for good and every
    later shape would stay on the device). An evicted pinned buffer goes back to torch's caching
    host allocator, which keeps it until the copies recorded on it are done."""

    def __init__(self, limit: int, pin: bool):
        self.limit, self.pin = limit, pin
        self.allocated = 0
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._used: list[torch.Tensor] = []

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        free = self._free.get((dtype, numel))
        if free:
            buf = free.pop()
        else:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if self.allocated + nbytes > self.limit:
                self._evict(self.allocated + nbytes - self.limit)
                if self.allocated + nbytes > self.limit:
                    return None
            buf = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self.allocated += nbytes
        self._used.append(buf)
        return buf

    def _evict(self, nbytes: int) -> None:
        """Drop free buffers, largest first, until ``nbytes`` are freed or none is left."""
        free = sorted(((b.numel() * b.element_size(), key) for key, bufs in self._free.items() for b in bufs),
                      key=lambda x: -x[0])
        for size, key in free:
            if nbytes <= 0:
                break
            self._free[key].pop()
            if not self._free[key]:
                del self._free[key]
            self.allocated -= size
            nbytes -= size

    def release_all(self) -> None:
        for buf in self._used:
            self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)
        self._used.clear()


class _Saved:
    """One offloaded tensor: its host copy, how to rebuild it, its prefetched device copy, and how
    many saved-tensor slots still read it (the same tensor saved by several ops is copied once)."""

    __slots__ = ("host", "shape", "dtype", "device", "requires_grad", "copied", "prefetched", "ready", "readers",
                 "before")

    def __init__(self, host, t: torch.Tensor, copied):
        self.host, self.shape, self.dtype, self.device = host, t.shape, t.dtype, t.device
        self.requires_grad = t.requires_grad
        self.copied = copied          # CUDA event: host copy finished (None on CPU)
        self.prefetched = None        # device tensor, once fetched, until its last reader takes it
        self.ready = None             # CUDA event: prefetch finished
        self.readers = 1              # packs of this tensor not yet unpacked
        self.before = None            # the tensor its module offloaded just before it, if any


def _identity(t: torch.Tensor) -> tuple:
    """What makes two packed tensors the same values: storage, offset, shape, strides, dtype and
    version (an in-place write bumps it)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            t._version)


class ActivationOffloader:
    def __init__(self, model: torch.nn.Module, patterns: list[str], host_limit_bytes: int,
                 device: torch.device | str = "cpu", meter=None):
        self.model = model
        self.patterns = list(patterns)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = _HostPool(host_limit_bytes, pin=self.cuda)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.meter = meter            # an engine.memory.tracker.SavedTensorsMeter for what stays on device
        self.stats = OffloadStats()
        self._handles: list = []
        self._order: list[int] = []               # module ids in this micro-batch's forward order
        self._saved: dict[int, list[_Saved]] = {}  # module id -> its offloaded tensors
        self._active: list = []                   # saved_tensors_hooks contexts entered by pre-hooks
        self._current: list[int] = []
        self._copies: dict[tuple, tuple] = {}     # _identity -> (weakref to the tensor, its _Saved or None: kept)
        self.modules = matching_modules(model, self.patterns)

    # ---- hooks --------------------------------------------------------------------------
    def attach(self) -> "ActivationOffloader":
        if not self.modules:
            raise ValueError(f"activation offload patterns {self.patterns} match no module")
        self.stats.modules = [n for n, _ in self.modules]
        for _name, mod in self.modules:
            self._handles.append(mod.register_forward_pre_hook(self._enter))
            self._handles.append(mod.register_forward_hook(self._exit))
            self._handles.append(mod.register_full_backward_pre_hook(self._prefetch_previous))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter(self, mod, _args):
        if not torch.is_grad_enabled() or _in_backward():
            self._active.append(None)
            return
        key = id(mod)
        if key not in self._saved:
            self._order.append(key)
            self._saved[key] = []
        self._current.append(key)
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._active.append(ctx)

    def _exit(self, _mod, _args, _out):
        ctx = self._active.pop() if self._active else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
            self._current.pop()

    # ---- pack / unpack ------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if _is_param(t) or _in_backward() or not self._current or t.layout != torch.strided:
            return t
        if t.device.type != self.device.type or type(t) is not torch.Tensor:
            return t  # a host scalar or index some op saved, or a tensor subclass: not ours to move
        key = _identity(t)
        seen = self._copies.get(key)
        if seen is not None and seen[0]() is t:  # q, k and v projections save one input: one copy
            if seen[1] is None:                  # kept on the device, and counted, already
                return t
            seen[1].readers += 1
            return seen[1]
        nbytes = t.numel() * t.element_size()
        host = self.pool.take(t.dtype, t.numel())
        if host is None:                     # over the host limit: stays on the device, counted
            self.stats.kept_bytes += nbytes
            self.stats.tensors_kept += 1
            self._copies[key] = (weakref.ref(t), None)
            if self.meter is not None:
                self.meter.add(t)
            return t
        # the host copy keeps the tensor's layout (a transposed view stays one), so backward gets
        # back what forward saved, strides included (kernels choose by layout)
        host = host.as_strided(t.shape, t.stride()) if _dense(t) else host.view(t.shape)
        copied = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            t.record_stream(self.stream)     # the allocator keeps t until the copy is done
        else:
            host.copy_(t)
        saved = _Saved(host, t, copied)
        self._copies[key] = (weakref.ref(t), saved)  # a dead ref: the address may hold another tensor now
        mine = self._saved[self._current[-1]]
        saved.before = mine[-1] if mine else None
        mine.append(saved)
        s = self.stats
        s.host_bytes += nbytes
        s.tensors_offloaded += 1
        s.pool_bytes = self.pool.allocated
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        return saved

    def _fetch(self, saved: _Saved) -> None:
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(saved.copied)
                saved.prefetched = saved.host.to(saved.device, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(self.stream)
        else:
            saved.prefetched = saved.host.clone()

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.prefetched is None:
            self.stats.fetched_on_demand += 1
            self._fetch(saved)
        t = saved.prefetched
        prev = saved.before  # backward reads a module's tensors in about the reverse order of forward:
        if prev is not None and prev.prefetched is None and prev.readers > 0:  # one ahead, within the module
            self._fetch(prev)  # (a module matched alone, as megatron's whole decoder under recompute, has
            self.stats.prefetched += 1  # no module before it to prefetch from)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(saved.ready)
            t.record_stream(torch.cuda.current_stream(self.device))
        saved.readers -= 1
        if saved.readers <= 0:  # the last reader has it: autograd frees it once the node has run
            saved.prefetched = None
        return t

    def _prefetch_previous(self, mod, _grad_output):
        """Backward reached ``mod``: bring back the saved tensors of the module before it."""
        key = id(mod)
        if key not in self._order:
            return None
        i = self._order.index(key)
        if i > 0:
            for saved in self._saved[self._order[i - 1]]:
                if saved.prefetched is None and saved.readers > 0:
                    self._fetch(saved)
                    self.stats.prefetched += 1
        return None

    # ---- between micro-batches ------------------------------------------------------------
    def end_micro_batch(self) -> OffloadStats:
        """After a micro-batch's backward: host buffers back to the pool; returns its stats."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        done = self.stats
        self.pool.release_all()
        self._order.clear()
        self._saved.clear()
        self._copies.clear()
        self.stats = OffloadStats(pool_bytes=self.pool.allocated, peak_host_bytes=done.peak_host_bytes,
                                  modules=done.modules)
        return done


def use_reentrant_checkpointing(model: torch.nn.Module) -> None:
    """Re-enable a transformers model's gradient checkpointing in reentrant mode, so that the
    inputs a checkpointed layer keeps pass through autograd's saved-tensor hooks (and so can be
    offloaded). Gradients are the same in both modes."""
    from engine.model.grad_checkpointing import enable_checkpointing

    enable_checkpointing(model, reentrant=True)


def make_activation_offloader(model: torch.nn.Module, engine_cfg, default_patterns: list[str],
                              device: torch.device) -> ActivationOffloader | None:
    """The offloader an engine config asks for (None when ``engine.activation_offload`` is off),
    attached to ``model``. Patterns that match no module are a ConfigError naming some module
    names to choose from."""
    from engine.errors import ConfigError

    if not engine_cfg.activation_offload:
        return None
    patterns = list(engine_cfg.activation_offload_modules) or list(default_patterns)
    limit = int(engine_cfg.activation_offload_host_cache_limit_gb * GiB)
    off = ActivationOffloader(model, patterns, limit, device)
    if not off.modules:
        names = [n for n, _ in model.named_modules() if n]
        blocks = sorted({n.rsplit(".", 1)[0] + ".*" for n in names if n.rsplit(".", 1)[-1].isdigit()})
        raise ConfigError(
            f"engine.activation_offload_modules={patterns} matches no module of this model. Patterns are globs "
            f"over module names; this model's repeated blocks are {blocks[:6] or names[:6]}. Leave the list empty "
            f"to offload every decoder layer.", title="invalid config value")
    return off.attach()
