"""Measure memory per phase of an RL step, per rank, as figures (not log strings).

    tracker = MemoryTracker(device, rank=rank, models={"policy": model, "ref": ref},
                            optimizer=optimizer)
    with tracker.phase("update", step=step):
        for mb in micro_batches:
            with tracker.activations():                 # saved-for-backward bytes of the forward
                out = model(mb.input_ids, attention_mask=mb.attention_mask)
            with tracker.saved_tensors("logits") as m:  # log-prob buffers
                m.add(out.logits)
                lp, _ = token_log_probs(out.logits, mb.input_ids)
            loss.backward()
            tracker.sample_state()                      # grads are live now
        optimizer.step()
    tracker.records()   # -> [dict], JSON-able, one per (step, phase)

Each phase starts by resetting the peak: on CUDA the allocator's peak stats; on CPU the
process's resident-set high-water mark (``/proc/self/clear_refs``; a sampling thread where that
is not available). At the end it records, on CUDA, allocated/reserved/peak and the device's
used bytes from ``mem_get_info`` (which sees memory outside torch: NCCL, vLLM, the CUDA
context); on every device the process RSS and its peak during the phase; and the bytes of live
tensors by category (``engine.memory.report.CATEGORIES``), each the largest seen in the phase:
params, grads and optimizer state are read from the attached model(s) and optimizer(s) at phase
start, at phase end and whenever ``sample_state()`` is called; activations and logits come from
``saved_tensors_hooks`` around forwards; FP8 workspaces from ``_fp8_workspaces``; the KV cache
is what the rollout reports with ``record_bytes("kv_cache", n)``.

Only tensors on the tracker's device count (offloaded state shows up under ``host_offload``).
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch

from engine.host_heap import heap_usage
from engine.memory.fp8_workspaces import fp8_workspace_bytes, iter_modules, storage_bytes, storage_key, tensors_in
from engine.memory.oom import oom_guard
from engine.memory.report import CATEGORIES, PHASES, PhaseRecord

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


# ---- host memory --------------------------------------------------------------------------
def process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _read_hwm() -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


class RssPeak:
    """Peak resident memory of this process between start() and stop().

    Uses the kernel's high-water mark, reset by writing 5 to /proc/self/clear_refs (Linux);
    elsewhere a daemon thread samples RSS every ``interval_s``.
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._peak = 0
        self.method = ""

    def start(self) -> None:
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
            if _read_hwm() is not None:
                self.method = "vmhwm"
                return
        except OSError:
            pass
        self.method = "sampled"
        self._peak = process_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="rss-peak", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, process_rss())

    def stop(self) -> int:
        if self.method == "vmhwm":
            return max(_read_hwm() or 0, process_rss())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return max(self._peak, process_rss())


# ---- saved-tensor meters ------------------------------------------------------------------
class SavedTensorsMeter:
    """Bytes of the distinct storages autograd saves for backward inside a ``with`` block,
    excluding parameter storages (weights saved by matmuls are counted as params).
    ``add(t)`` counts extra live tensors (e.g. logits the block produces)."""

    def __init__(self, exclude: set):
        self._exclude = exclude
        self._seen: set = set()
        self._alive: list = []   # hold counted storages so a freed address is never re-used in-block
        self.bytes = 0
        self.tensors = 0

    def _count(self, t: torch.Tensor) -> None:
        # weights saved by matmuls are params, including FSDP2's all-gathered (unsharded) ones,
        # which are freed during forward and are not in the exclusion set
        if isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter):
            return
        for inner in tensors_in(t):
            k = storage_key(inner)
            if k in self._exclude or k in self._seen:
                continue
            self._seen.add(k)
            self._alive.append(inner)
            self.bytes += storage_bytes([inner])
            self.tensors += 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def add(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t)

    def close(self) -> None:
        """The block is over: let go of the counted tensors (held only so that no address is
        reused while it runs), which backward would otherwise find still alive after using them."""
        self._alive.clear()
        self._seen.clear()


# ---- the tracker --------------------------------------------------------------------------
class MemoryTracker:
    """Per-phase memory records for one rank. Not thread-safe; one phase at a time."""

    def __init__(self, device: torch.device | str = "cpu", *, rank: int = 0, models=None,
                 optimizer=None, rss_interval_s: float = 0.005):
        self.device = torch.device(device)
        self.rank = rank
        self.step = 0
        self._models: dict = {}
        self._optimizers: list = []
        self.attach(models=models, optimizer=optimizer)
        self._records: list[PhaseRecord] = []
        self._current: dict | None = None
        self._rss_interval_s = rss_interval_s
        self._saved_by_key: dict = {}  # (category, key) -> bytes saved (saved_tensors)

    # -- what to measure --
    def attach(self, models=None, optimizer=None) -> None:
        """Models (a module, a list of chunks, or {name: module}) and optimizer(s) to read."""
        if models is not None:
            if isinstance(models, dict):
                self._models.update(models)
            else:
                self._models[f"model{len(self._models)}"] = models
        if optimizer is not None:
            self._optimizers.extend(optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and t.untyped_storage().nbytes() > 0

    def _params(self):
        seen = set()
        for model in self._models.values():
            for m in iter_modules(model):
                for p in m.parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield p

    def _param_storage_keys(self) -> set:
        return {storage_key(t) for p in self._params() for t in tensors_in(p) if t.device.type != "meta"}

    def state_bytes(self) -> dict[str, int]:
        """Bytes on this device now: params, grads, optimizer state, FP8 workspaces."""
        from engine.memory.offload import optimizer_state_tensors

        params = list(self._params())
        on_dev = self._on_device
        p_tensors = [t for p in params for t in tensors_in(p) if on_dev(t)]
        g_tensors = []
        for p in params:
            if p.grad is not None:
                g_tensors.extend(t for t in tensors_in(p.grad) if on_dev(t))
            mg = getattr(p, "main_grad", None)
            if isinstance(mg, torch.Tensor) and on_dev(mg):
                g_tensors.append(mg)
        o_tensors = [t for opt in self._optimizers for t in optimizer_state_tensors(opt) if on_dev(t)]
        # what the optimizer steps: the model's own params (FSDP2, fp32 megatron: counted as params
        # above, left out below) or fp32 masters of low-precision params (megatron's MainGradAdamW)
        o_tensors += [t for opt in self._optimizers for group in getattr(opt, "param_groups", ())
                      for p in group["params"] for t in tensors_in(p) if on_dev(t)]
        p_seen: set = set()
        out = {"params": storage_bytes(p_tensors, p_seen),
               "grads": storage_bytes(g_tensors),
               "optimizer": storage_bytes(o_tensors, set(p_seen))}   # master params are not params
        out["fp8_workspaces"] = sum(fp8_workspace_bytes(m)[1] for m in self._models.values())
        return out

    # -- phases --
    @contextmanager
    def phase(self, name: str, step: int | None = None):
        """Measure one phase; the peak is reset when it starts."""
        if name not in PHASES:
            raise ValueError(f"unknown memory phase {name!r}; phases are: {', '.join(PHASES)}")
        if self._current is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._current['phase']!r}")
        if step is not None:
            self.step = step
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        rss = RssPeak(self._rss_interval_s)
        rss.start()
        self._current = {"phase": name, "categories": {c: 0 for c in CATEGORIES}, "notes": [],
                         "offload": None, "t0": time.perf_counter()}
        self.sample_state()
        try:
            with oom_guard(name, self.rank, self.step, self.device):  # an OOM here: the answer (engine/memory/oom.py)
                yield self
        finally:
            try:
                self.sample_state()
                self._finish(rss, cuda)
            finally:
                self._current = None

    def _finish(self, rss: RssPeak, cuda: bool) -> None:
        from engine.memory.offload import host_memory_held

        cur = self._current
        rec = PhaseRecord(phase=cur["phase"], step=self.step, rank=self.rank, device=str(self.device),
                          seconds=round(time.perf_counter() - cur["t0"], 6),
                          categories=dict(cur["categories"]), offload=cur["offload"], notes=cur["notes"])
        if cuda:
            torch.cuda.synchronize(self.device)
            rec.allocated = int(torch.cuda.memory_allocated(self.device))
            rec.reserved = int(torch.cuda.memory_reserved(self.device))
            rec.peak_allocated = int(torch.cuda.max_memory_allocated(self.device))
            rec.peak_reserved = int(torch.cuda.max_memory_reserved(self.device))
            free, total = torch.cuda.mem_get_info(self.device)
            rec.device_used, rec.device_total = int(total - free), int(total)
            rec.non_torch = max(0, rec.device_used - rec.reserved)
        rec.peak_rss = int(rss.stop())
        rec.rss = process_rss()
        heap = heap_usage()
        if heap is not None:
            rec.heap_in_use, rec.heap_held = heap
        if rss.method == "sampled":
            rec.notes.append(f"peak RSS sampled every {self._rss_interval_s * 1000:.0f} ms")
        rec.host_offload = host_memory_held()
        self._records.append(rec)

    def _bump(self, category: str, nbytes: int) -> None:
        if self._current is not None:
            cats = self._current["categories"]
            cats[category] = max(cats.get(category, 0), int(nbytes))

    def sample_state(self) -> dict[str, int]:
        """Read params/grads/optimizer/FP8 bytes now; the phase keeps the largest of each."""
        b = self.state_bytes() if (self._models or self._optimizers) else {}
        for c, v in b.items():
            self._bump(c, v)
        return b

    @contextmanager
    def saved_tensors(self, category: str = "activations", key=None):
        """Count what autograd saves inside the block (one forward) under ``category``.

        ``key``: everything the saved bytes depend on (the model, the forward's input shapes and
        layout, grad mode, train mode), or None. A key measured before reuses its bytes and runs
        the block without hooks (yielding None): the pack/unpack hooks are a Python call per
        saved tensor and its unpacking, ~8% of a small update on a CPU (docs/benchmarks.md, issue
        17), while the same shapes through the same code save the same bytes. Bucketed
        micro-batches repeat shapes, so most steps reuse a measurement."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; categories are: {', '.join(CATEGORIES)}")
        if key is not None and (category, key) in self._saved_by_key:
            self._bump(category, self._saved_by_key[(category, key)])
            yield None
            return
        meter = SavedTensorsMeter(self._param_storage_keys())
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            yield meter
        meter.close()
        self._bump(category, meter.bytes)
        if key is not None:
            self._saved_by_key[(category, key)] = meter.bytes

    def activations(self):
        """``saved_tensors("activations")``: wrap one model forward."""
        return self.saved_tensors("activations")

    def record_bytes(self, category: str, nbytes: int) -> None:
        """Report bytes the tracker cannot see itself (the rollout's KV cache, a vLLM pool)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; categories are: {', '.join(CATEGORIES)}")
        self._bump(category, nbytes)

    def record_tensors(self, category: str, *tensors: torch.Tensor) -> int:
        """Report live tensors under ``category`` (distinct storages); returns their bytes."""
        n = storage_bytes(t for x in tensors for t in tensors_in(x))
        self.record_bytes(category, n)
        return n

    def record_offload(self, report) -> None:
        """Attach an OffloadReport (from engine.offload()/onload()) to the current phase."""
        if self._current is not None:
            self._current["offload"] = asdict(report)

    def note(self, text: str) -> None:
        if self._current is not None:
            self._current["notes"].append(text)

    # -- results --
    def phase_records(self) -> list[PhaseRecord]:
        return list(self._records)

    def records(self) -> list[dict]:
        """Every finished phase as a JSON-able dict (see PhaseRecord)."""
        return [r.to_json() for r in self._records]

    def pop_records(self) -> list[dict]:
        """records(), then forget them (for a worker that ships them each step)."""
        out = self.records()
        self._records.clear()
        return out
