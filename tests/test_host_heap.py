"""A rank keeps the host memory a step frees for the next step (engine/host_heap.py).

Protects the issue-17 speed-up: with glibc's defaults every CPU training step page-faults its
activations in again (~45,000 minor faults an update at the benchmark shape). The measurement
runs in a fresh interpreter, because malloc's thresholds are per process and change as it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.config.load import load_run_config
from engine.config.resolved import resolve_run

# Allocate and free a step's worth of activation-sized tensors twice; print the minor page
# faults of the second "step", when the memory could have been reused.
_STEPS = """
import resource, sys, torch
from engine.host_heap import keep_host_heap
note = keep_host_heap() if sys.argv[1] == "tuned" else "default"
def step():
    xs = [torch.ones(1_000_000 + 4096 * i) for i in range(24)]  # 4-5 MB each, ~100 MB in all
    del xs
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, note or "tuned")
"""


def _second_step_faults(mode: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True)
    faults, note = out.stdout.split(maxsplit=1)
    return int(faults), note.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_a_tuned_process_reuses_freed_memory_without_page_faults():
    default, _ = _second_step_faults("default")
    tuned, note = _second_step_faults("tuned")
    assert note == "tuned"
    assert default > 10_000  # ~100 MB of 4 KiB pages faulted in again: what glibc's defaults do
    assert tuned < default / 10, (tuned, default)  # measured ~980 against ~24,500


@pytest.mark.parametrize("keep", [True, False])
def test_the_rank_tunes_its_heap_unless_keep_host_heap_is_false(monkeypatch, keep):
    import engine.trainer.worker as worker

    calls = []
    monkeypatch.setattr(worker, "keep_host_heap", lambda: calls.append(1) or "")
    cfg = load_run_config(["trainer.device=cpu", f"trainer.keep_host_heap={str(keep).lower()}"]).config
    before = torch.get_num_threads()
    try:
        worker.RankWorker(resolve_run(cfg), 0, 1, 1).shutdown()
    finally:
        torch.set_num_threads(before)
    assert calls == ([1] if keep else [])
