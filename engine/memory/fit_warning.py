"""A run's memory estimate checked against its GPU before anything is built.

On a GPU, rank 0 estimates the run (engine/memory/estimate.py, what `rl mem-report` shows) against
its device's total memory. When the estimated peak is over it, the run is warned at its start,
with the phase that peaks and the estimate's best fixes, instead of running out of memory minutes
later, often at a point that hides the cause: vLLM's wake after the first update (its pool was
sized at start, before the trainer's AdamW state existed), or the first update itself. A warning,
not a refusal: the estimate is a model of the allocator, and a run the estimate doubts may still
fit."""

from __future__ import annotations

from engine.memory.report import MemoryEstimate

GiB = 1 << 30


def fit_warning(est: MemoryEstimate, fixes: int = 3) -> str:
    """'' when the estimate fits its device (or the device is unknown); else one paragraph."""
    device = est.device_memory_bytes
    if not device or est.peak_bytes <= device:
        return ""
    best = "; ".join(f"{' '.join(f.overrides)} ({f.name}: peak {f.new_peak_bytes / GiB:.2f} GiB"
                     + (", fits" if f.fits else "") + ")" for f in est.fixes[:fixes])
    return (f"this run's estimated peak on the device is {est.peak_bytes / GiB:.2f} GiB in the {est.peak_phase} "
            f"phase, over the device's {device / GiB:.2f} GiB: it is likely to run out of memory there. "
            + (f"The estimate's best fixes: {best}. " if best else "")
            + "`rl mem-report` with the same overrides shows every phase.")
