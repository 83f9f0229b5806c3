"""A run whose estimated peak is over its GPU is warned at its start with the phase and the fixes
(engine/memory/fit_warning.py); for colocated vLLM the fixes include the largest
rollout.gpu_memory_utilization with which the rollout phase (vLLM's share beside the trainer's
resident state, AdamW's included) fits."""

from __future__ import annotations

import math

MiB = 1 << 20


def _estimate(overrides, device):
    from engine.config.load import load_run_config
    from engine.memory.estimate import estimate_memory

    return estimate_memory(load_run_config(overrides).config, device_memory_bytes=device)


def test_vllm_share_over_the_device_is_warned_with_the_share_that_fits():
    from engine.memory.fit_warning import fit_warning

    device = 64 * MiB
    est = _estimate(["rollout=vllm", "rollout.gpu_memory_utilization=0.99"], device)
    rollout = est.phase("rollout")
    assert est.peak_phase == "rollout" and rollout.total > device
    rest = rollout.total - int(0.99 * device)  # everything in the phase but vLLM's share
    want = math.floor((device - rest) / device * 100) / 100
    (fix,) = [f for f in est.fixes if f.name == "smaller vLLM share"]
    assert fix.overrides == [f"rollout.gpu_memory_utilization={want}"] and fix.fits
    again = _estimate(["rollout=vllm", f"rollout.gpu_memory_utilization={want}"], device)
    assert again.phase("rollout").total <= device and not fit_warning(again)
    msg = fit_warning(est)
    assert "rollout phase" in msg and f"rollout.gpu_memory_utilization={want}" in msg and "fits" in msg


def test_no_warning_when_it_fits_or_the_device_is_unknown():
    from engine.memory.fit_warning import fit_warning

    assert fit_warning(_estimate(["rollout=vllm", "rollout.gpu_memory_utilization=0.9"], 64 * MiB)) == ""
    assert fit_warning(_estimate([], 0)) == ""
    big = _estimate([], 16 * MiB)  # the default job's update does not fit 16 MiB; vLLM is not involved
    assert "update phase" in fit_warning(big) and "smaller vLLM share" not in fit_warning(big)
