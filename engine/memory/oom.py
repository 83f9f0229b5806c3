"""Out of memory as an answer: an OOM in any phase, on any rank or the driver, ends the run with
exit 2 and one paragraph naming the phase, the rank, the peak and the top fix of the memory
estimate (engine/memory/estimate.py, what `rl mem-report` ranks), never a traceback.

Where it is caught:

- on a rank, every measured phase (``MemoryTracker.phase``: rollout, log-probs, values, update,
  critic update, weight sync, offload, onload) and the unmeasured ones through ``oom_guard``
  (loading the model, saving and loading a checkpoint): the error (``MemoryError``,
  ``torch.OutOfMemoryError`` on CUDA, the CPU allocator's "can't allocate memory") becomes an
  ``OutOfMemory`` with the phase, rank, step and peak, which Ray carries to the driver like
  any UserError (engine/trainer/worker_group.py);
- on the driver, the reward phase and the rest of a step through ``oom_guard``;
- the trainer adds the estimate's top fix and where the last checkpoint is (``answer``); a
  half-written ``.tmp-step_N`` is never a checkpoint, so the last one stays as it was.

Test hooks (test-only; nothing in a real run sets them), read when a phase starts:

- ``RL_TEST_RAISE_OOM=PHASE:RANK[:device|host[:STEP]]``: raise ``torch.OutOfMemoryError``
  (device, the default) or ``MemoryError`` (host) at the start of PHASE on RANK ("driver" for
  the driver's phases), at step STEP (default: every step) — how a CUDA OOM is driven through
  the real path on a CPU machine;
- ``RL_TEST_MEMORY_LIMIT=PHASE:RANK:BYTES[:STEP]``: when PHASE starts on RANK (at STEP), limit
  what the process may still allocate to BYTES: on a CPU rank its address space (RLIMIT_AS, what
  it maps now + BYTES), on a CUDA rank the caching allocator
  (``torch.cuda.set_per_process_memory_fraction``, what it has reserved + BYTES), so the phase's
  own allocations fail for real.
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from engine.errors import UserError

RAISE_ENV = "RL_TEST_RAISE_OOM"
LIMIT_ENV = "RL_TEST_MEMORY_LIMIT"

# what each phase is, in the words of the answer (engine/memory/report.PHASES and the unmeasured ones)
PHASE_WORDS = {
    "rollout": "the rollout (sampling responses)", "reward": "the reward (scoring responses)",
    "ref_log_probs": "the reference log-probs", "old_log_probs": "the old log-probs",
    "values": "the critic's values", "update": "the policy update", "critic_update": "the critic update",
    "weight_sync": "the weight sync to the rollout engine", "offload": "the offload after a step",
    "onload": "the onload before a phase", "load_model": "loading the model",
    "save_checkpoint": "the checkpoint save", "load_checkpoint": "the checkpoint load",
    "step": "the step on the driver",
}


def oom_kind(exc: BaseException) -> Optional[str]:
    """"device", "host" or None: whether ``exc`` says an allocation failed for lack of memory."""
    if isinstance(exc, MemoryError):
        return "host"
    names = {c.__name__ for c in type(exc).__mro__}
    text = str(exc)
    if "OutOfMemoryError" in names:  # torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class)
        return "host" if "CPU" in text and "CUDA" not in text else "device"
    if isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "Cannot allocate memory" in text):
        return "host"  # the CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried to allocate"
    if isinstance(exc, RuntimeError) and "CUDA out of memory" in text:
        return "device"
    return None


def _gib(n: Optional[int]) -> str:
    return "unknown" if not n else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


class OutOfMemory(UserError):
    """A phase ran out of host or device memory (exit 2: the config asks for more than there is)."""

    def __init__(self, message: str = "", *, phase: str = "", rank: Optional[int] = None, kind: str = "host",
                 peak_bytes: Optional[int] = None, limit_bytes: Optional[int] = None, step: Optional[int] = None,
                 detail: str = "", title: str = "out of memory"):
        self.phase, self.rank, self.kind, self.step = phase, rank, kind, step
        self.peak_bytes, self.limit_bytes, self.detail = peak_bytes, limit_bytes, detail
        super().__init__(message or self.what(), title=title)

    def __reduce__(self):  # Ray pickles a rank's exception to the driver
        return (_rebuild, (self.message, self.phase, self.rank, self.kind, self.peak_bytes, self.limit_bytes,
                           self.step, self.detail, self.title))

    @property
    def where(self) -> str:
        return "the driver" if self.rank is None else f"rank {self.rank}"

    def what(self, where: str = "") -> str:
        """The first sentence: which memory, which phase, where (``where``: the rank's node too), the peak."""
        mem = "device (GPU)" if self.kind == "device" else "host"
        peak = f"peak {'allocated' if self.kind == 'device' else 'resident'} memory {_gib(self.peak_bytes)}"
        if self.limit_bytes:
            peak += (f", address space limited to {_gib(self.limit_bytes)}" if self.kind == "host" else
                     f" of {_gib(self.limit_bytes)}")
        at = f" at step {self.step}" if self.step else ""
        return (f"Out of {mem} memory in {PHASE_WORDS.get(self.phase, self.phase)} (phase {self.phase}) on "
                f"{where or self.where}{at}: {peak}" + (f" ({self.detail})" if self.detail else "") + ".")


def _rebuild(message, phase, rank, kind, peak, limit, step, detail, title):
    return OutOfMemory(message, phase=phase, rank=rank, kind=kind, peak_bytes=peak, limit_bytes=limit, step=step,
                       detail=detail, title=title)


# ---- measuring what was reached ----------------------------------------------------------
def host_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_limit_bytes() -> Optional[int]:
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def device_peak_and_total(device) -> tuple[Optional[int], Optional[int]]:
    try:
        import torch

        if torch.cuda.is_available() and getattr(device, "type", str(device)).startswith("cuda"):
            return (int(torch.cuda.max_memory_allocated(device)),
                    int(torch.cuda.get_device_properties(device).total_memory))
    except Exception:  # noqa: BLE001 - a figure we cannot read is shown as unknown
        pass
    return None, None


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def to_oom(exc: BaseException, kind: str, *, phase: str, rank: Optional[int], step: Optional[int], device=None,
           peak_bytes: Optional[int] = None) -> OutOfMemory:
    """The OutOfMemory for ``exc`` (caught in ``phase`` on ``rank``; None = the driver)."""
    limit = None
    if kind == "device":
        measured, limit = device_peak_and_total(device)
        if measured is None:  # a CPU rank: its "device" memory is host memory
            kind = "host"
        peak_bytes = peak_bytes or measured
    if kind == "host":
        peak_bytes = peak_bytes or host_peak_bytes()
        limit = host_limit_bytes()
    return OutOfMemory(phase=phase, rank=rank, kind=kind, peak_bytes=peak_bytes, limit_bytes=limit, step=step,
                       detail=_short(exc))


def _free(exc: BaseException) -> None:
    """Drop what the failed phase's frames hold (its tensors), so the error is built in memory."""
    try:
        exc.__traceback__ = None
        import gc

        gc.collect()
        if "torch" in sys.modules:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


@contextmanager
def oom_guard(phase: str, rank: Optional[int], step: Optional[int] = None, device=None,
              peak: Optional[Callable[[], Optional[int]]] = None):
    """Run the block; an out-of-memory in it becomes ``OutOfMemory`` naming ``phase`` and ``rank``."""
    try:
        test_hooks(phase, rank, step, device)
        yield
    except OutOfMemory as e:  # from an inner phase: it names the phase; this guard may know the step
        if e.step is None:
            e.step = step
        raise
    except BaseException as e:  # noqa: BLE001 - only out-of-memory errors are turned into the answer
        kind = oom_kind(e)
        if kind is None:
            raise
        _free(e)
        raise to_oom(e, kind, phase=phase, rank=rank, step=step, device=device,
                     peak_bytes=peak() if peak else None) from None


# ---- test hooks --------------------------------------------------------------------------
def _matches(spec: str, phase: str, rank: Optional[int], step: Optional[int]) -> list[str] | None:
    parts = spec.split(":")
    if len(parts) < 2 or parts[0] != phase:
        return None
    who = "driver" if rank is None else str(rank)
    if len(parts) >= 4 and parts[3] and str(step) != parts[3]:
        return None
    return parts if parts[1] == who else None


def test_hooks(phase: str, rank: Optional[int], step: Optional[int] = None, device=None) -> None:
    """The test-only hooks of the module docstring; nothing happens unless their variable is set."""
    spec = os.environ.get(LIMIT_ENV)
    parts = _matches(spec, phase, rank, step) if spec else None
    if parts and len(parts) >= 3:
        _limit_memory(int(parts[2]), device)
    spec = os.environ.get(RAISE_ENV)
    parts = _matches(spec, phase, rank, step) if spec else None
    if parts:
        if len(parts) >= 3 and parts[2] == "host":
            raise MemoryError(f"{RAISE_ENV}: injected host out-of-memory in {phase}")
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({RAISE_ENV}: injected in "
                                     f"{phase})")


def oom_test_env() -> dict[str, str]:
    """The hooks' variables set on the driver, for the ranks' environment (empty in a real run)."""
    return {k: os.environ[k] for k in (RAISE_ENV, LIMIT_ENV) if os.environ.get(k)}


def _limit_memory(headroom: int, device) -> None:
    if getattr(device, "type", None) == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        allowed = torch.cuda.memory_reserved(device) + headroom
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), device)
        return
    mapped = _mapped_bytes()
    if mapped:
        resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _mapped_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---- the answer --------------------------------------------------------------------------
def top_fix(cfg) -> Optional[object]:
    """The memory estimate's best fix for ``cfg`` (engine.memory.report.Fix), or None."""
    try:
        from engine.memory.estimate import estimate_memory

        est = estimate_memory(cfg)
    except Exception:  # noqa: BLE001 - no estimate (an unreadable model config): the answer says so
        return None
    return est.fixes[0] if est.fixes else None


def answer(err: OutOfMemory, cfg, run_dir: Path, where: str = "") -> OutOfMemory:
    """``err`` completed for the user: where the rank ran, the estimate's top fix, and what to
    run next from the last checkpoint (which the failed phase never touched)."""
    from engine.checkpoint.layout import latest_complete
    from engine.checkpoint.resume_rules import classify

    parts = [err.what(where)]
    fix = top_fix(cfg)
    fix_args = ""
    if fix is not None:
        fix_args = " ".join(fix.overrides)
        parts.append(f"Top fix from the memory estimate (`rl mem-report`): {fix.name}, `{fix_args}` ({fix.why}; "
                     f"lowers the estimated per-rank peak by {_gib(fix.bytes_saved)}).")
    else:
        parts.append("See `rl mem-report` with this run's overrides for where the memory goes and what lowers it.")
    if err.kind == "device":
        parts.append("Offloading (engine.param_offload / engine.optimizer_offload / engine.activation_offload) "
                     "trades device memory for host memory.")
    latest = latest_complete(Path(run_dir))
    resumable = fix is not None and all(classify(o.split("=", 1)[0])[0] for o in fix.overrides)
    if latest is None:
        parts.append(f"No checkpoint was saved yet: start again with the fix (`checkpoint.overwrite=true` replaces "
                     f"{run_dir}).")
    elif resumable:
        parts.append(f"The last checkpoint, {latest.path}, is intact: continue with `rl resume {run_dir} {fix_args}`.")
    else:
        parts.append(f"The last checkpoint, {latest.path}, is intact"
                     + (f"; `{fix_args}` cannot change on resume, so start a new run with it, or continue with "
                        f"`rl resume {run_dir}` and a change it allows (e.g. engine.max_tokens_per_micro_batch)."
                        if fix is not None else f": continue with `rl resume {run_dir}` once memory allows."))
    return OutOfMemory(" ".join(parts), phase=err.phase, rank=err.rank, kind=err.kind, peak_bytes=err.peak_bytes,
                       limit_bytes=err.limit_bytes, step=err.step, detail=err.detail)


# ---- a process killed for memory (nothing to catch in it) ---------------------------------
# what Ray's memory monitor says when it kills a worker (ray.exceptions.OutOfMemoryError, or the
# death cause of an actor it killed)
_RAY_KILL_WORDS = ("running low on memory", "running out of memory", "memory usage threshold")


def killed_for_memory(error_text: str, oom_kills_before: Optional[int]) -> str:
    """Why a lost process was killed for memory, in words, or '' when nothing says so: Ray's
    memory monitor (its error text) or the kernel's OOM killer (the oom_kill count of this
    process's cgroup, cgroup v2 ``memory.events``, which counts its whole subtree: a local Ray's
    workers included, grew since ``oom_kills_before``)."""
    text = " ".join(str(error_text).split())
    if any(w in text.lower() for w in _RAY_KILL_WORDS):
        first = next((s for s in text.split(". ") if any(w in s.lower() for w in _RAY_KILL_WORDS)), text)
        return f"killed by Ray's memory monitor: {first[:200].rstrip('.')}"
    now = cgroup_oom_kills()
    if oom_kills_before is not None and now is not None and now > oom_kills_before:
        return f"killed by the kernel's OOM killer: this cgroup's oom_kill count went {oom_kills_before} -> {now}"
    return ""


def cgroup_oom_kills() -> Optional[int]:
    """The ``oom_kill`` count of this process's memory cgroup and its descendants: cgroup v2
    ``memory.events``, or v1 ``memory.oom_control``; None where neither is readable."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    places = []
    for parts in lines:
        if len(parts) == 3 and "memory" in parts[1].split(","):   # v1: "4:memory:/path"
            places.append(os.path.join("/sys/fs/cgroup/memory", parts[2].lstrip("/"), "memory.oom_control"))
        elif len(parts) == 3 and parts[0] == "0" and parts[1] == "":  # v2: "0::/path"
            places.append(os.path.join("/sys/fs/cgroup", parts[2].lstrip("/"), "memory.events"))
    for place in places:
        try:
            with open(place) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None
