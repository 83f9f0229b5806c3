"""Out of memory is an answer, not a traceback (engine/memory/oom.py).

An OOM in any phase, on any rank or on the driver, ends `rl train` / `rl resume` with exit 2 and
one paragraph naming the phase, the rank, the peak and the memory estimate's top fix, and the
last checkpoint stays intact. Fast tests: what counts as an OOM (a real failed CPU allocation
included), the error surviving Ray's pickling, every measured phase converting it, the answer's
fix and next command. Slow tests: real runs with a device OOM injected on rank 1 of 2 in the
update, a host OOM in the checkpoint save and in the driver's reward phase, and a real host OOM
under RLIMIT_AS in a resumed run's update. A `gpu` test makes a real CUDA allocation fail.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from engine.checkpoint.verify import verify_step
from engine.config.load import load_run_config
from engine.memory.estimate import estimate_memory
from engine.memory.oom import LIMIT_ENV, RAISE_ENV, OutOfMemory, answer, oom_guard, oom_kind
from engine.memory.report import PHASES
from engine.memory.tracker import MemoryTracker
from tests.cli_utils import flat, rl, rl_concurrently

RL_ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}
TINY = ["data.train_batch_size=4", "algorithm.rollout_n=2", "checkpoint.save_freq=2"]


def test_what_counts_as_out_of_memory():
    """MemoryError and torch.OutOfMemoryError are host / device OOMs; the CPU allocator's real
    failure (a RuntimeError) is a host OOM; any other error is not one."""
    with pytest.raises(RuntimeError) as real:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator refuses it
    assert oom_kind(real.value) == "host"
    assert oom_kind(MemoryError()) == "host"
    assert oom_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "device"
    assert oom_kind(RuntimeError("shape mismatch")) is None and oom_kind(ValueError("x")) is None


def test_a_real_failed_allocation_becomes_the_answer_and_other_errors_pass():
    """oom_guard turns a real allocation failure into OutOfMemory naming the phase, rank and
    step with the process's peak; the error crosses Ray's pickling with every field; an error
    that is not an OOM passes through unchanged."""
    with pytest.raises(OutOfMemory) as e:
        with oom_guard("update", 1, 3):
            torch.empty(1 << 50, dtype=torch.uint8)
    err = e.value
    assert (err.phase, err.rank, err.step, err.kind, err.exit_code) == ("update", 1, 3, "host", 2)
    assert err.peak_bytes > 0 and "can't allocate memory" in err.detail
    assert "the policy update (phase update) on rank 1 at step 3: peak resident memory" in err.message
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, OutOfMemory) and vars(back) == vars(err)
    with pytest.raises(ValueError):
        with oom_guard("update", 1, 3):
            raise ValueError("not memory")


@pytest.mark.parametrize("kind", ["device", "host"])
def test_every_measured_phase_answers(monkeypatch, kind):
    """Each phase a rank measures (rollout, log-probs, values, update, ...) converts an OOM raised
    in it (the test hook at its start) into OutOfMemory naming it; its memory record is still
    written."""
    tracker = MemoryTracker("cpu", rank=1)
    for phase in PHASES:
        monkeypatch.setenv(RAISE_ENV, f"{phase}:1:{kind}")
        with pytest.raises(OutOfMemory) as e:
            with tracker.phase(phase, step=5):
                pass
        assert (e.value.phase, e.value.rank, e.value.step) == (phase, 1, 5)
        assert f"(phase {phase}) on rank 1 at step 5" in e.value.message
        assert tracker.records()[-1]["phase"] == phase
    monkeypatch.setenv(RAISE_ENV, "update:0")  # another rank's hook: nothing happens here
    with tracker.phase("update", step=6):
        pass


def test_answer_names_the_estimates_top_fix_and_the_next_command(tmp_path):
    """The answer carries the fix `rl mem-report` ranks first for the run's config, and `rl resume`
    with it when resume allows the change (else a new run); no checkpoint -> start again."""
    cfg = load_run_config(TINY).config
    top = estimate_memory(cfg).fixes[0]
    err = OutOfMemory(phase="update", rank=0, kind="host", peak_bytes=1 << 30, step=3)
    run = tmp_path / "run"
    (run / "step_2").mkdir(parents=True)
    (run / "step_2" / "manifest.json").write_text("{}")
    msg = answer(err, cfg, run).message
    fix = " ".join(top.overrides)
    assert f"Top fix from the memory estimate (`rl mem-report`): {top.name}, `{fix}`" in msg
    assert f"The last checkpoint, {run / 'step_2'}, is intact: continue with `rl resume {run} {fix}`." in msg
    assert "No checkpoint was saved yet" in answer(err, cfg, tmp_path / "empty").message


# ---- real runs ----------------------------------------------------------------------------
def _assert_answer(r, phase: str, where: str, run: Path, cfg_args: list[str], intact: str | None) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    msg = flat(r.stderr)
    assert f"(phase {phase}) on {where}" in msg and "peak" in msg, msg[-2000:]
    top = estimate_memory(load_run_config(cfg_args).config).fixes[0]
    assert f"Top fix from the memory estimate (`rl mem-report`): {top.name}, `{' '.join(top.overrides)}`" in msg
    if intact:
        assert f"The last checkpoint, {run / intact}, is intact" in msg, msg[-2000:]
        v = verify_step(run / intact, json.loads((run / intact / "manifest.json").read_text()), content=True)
        assert v.ok, v.problems
    assert not list(run.glob(".tmp-step_*"))
    return msg


@pytest.mark.slow
def test_oom_in_a_rank_the_save_and_the_driver_is_exit_2_with_the_fix(tmp_path):
    """Three real runs, each stopped by an OOM at step 3 or 4 after step_2 was saved: a CUDA OOM
    in rank 1's update (of 2 ranks; rank 0 waits in the collective), a host OOM in rank 0's
    checkpoint save of step 4 (its unfinished .tmp-step_4 removed) and one in the driver's
    reward phase. Each: exit 2, no traceback, the phase, the rank, the peak, the estimate's top
    fix, and step_2 verifies byte for byte."""
    cases = [("update:1:device:3", ["trainer.nprocs=2"], "update", "rank 1 on node"),
             ("save_checkpoint:0:host:4", [], "save_checkpoint", "rank 0 on node"),
             ("reward:driver:host:3", [], "reward", "the driver at step 3")]
    calls, envs = [], []
    for i, (hook, extra, _, _) in enumerate(cases):
        calls.append(["train", *TINY, "trainer.total_steps=4", *extra, f"checkpoint.dir={tmp_path / str(i)}"])
    # one variable per process: rl_concurrently gives all the same environment, so each run's
    # hook is chosen by its run directory in a `pre` snippet
    pre = ("import os, sys\n"
           f"hooks = {json.dumps({str(tmp_path / str(i)): c[0] for i, c in enumerate(cases)})}\n"
           "d = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('checkpoint.dir='))\n"
           f"os.environ['{RAISE_ENV}'] = hooks[d]\n")
    results = rl_concurrently(*calls, timeout=900, env=RL_ENV, pre=pre)
    for i, ((_, extra, phase, where), r) in enumerate(zip(cases, results)):
        msg = _assert_answer(r, phase, where, tmp_path / str(i), [*TINY, "trainer.total_steps=4", *extra], "step_2")
        if phase == "update":
            assert "CUDA out of memory" in msg


@pytest.mark.slow
def test_a_real_host_oom_under_rlimit_as_in_a_resumed_update(tmp_path):
    """A run with wide MLPs saves step_2; `rl resume` to step 4 with rank 0's address space
    limited (RLIMIT_AS: what it maps + 32 MiB) when step 3's update starts: the update's real
    allocations fail, and the answer names the update, rank 0, the peak and the address-space
    limit; step_2 is intact."""
    run = tmp_path / "run"
    # every row trained (none skipped for a zero advantage): step 3's update must run its wide
    # forward and backward whatever the sampled rewards were (they vary with the GEMM's summation order)
    args = [*TINY, "model.intermediate_size=65536", "engine.skip_zero_advantage_rows=false", "trainer.total_steps=2",
            "trainer.ray_timeout_s=300"]
    r = rl("train", *args, f"checkpoint.dir={run}", env=RL_ENV, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = rl("resume", str(run), "trainer.total_steps=4", env={**RL_ENV, LIMIT_ENV: f"update:0:{32 << 20}:3"},
           timeout=900)
    msg = _assert_answer(r, "update", "rank 0 on node", run, [*args[:-2], "trainer.total_steps=4"], "step_2")
    assert "can't allocate memory" in msg and "address space limited to" in msg


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_oom_in_the_update(tmp_path):
    """On a GPU: the caching allocator limited to what it holds + 1 MiB when step 1's update
    starts (torch.cuda.set_per_process_memory_fraction), so the update's gradients fail to
    allocate for real: exit 2 naming device memory, the update, rank 0 and the peak."""
    run = tmp_path / "run"
    args = [*TINY, "model.intermediate_size=65536", "trainer.total_steps=2", "trainer.device=cuda"]
    r = rl("train", *args, f"checkpoint.dir={run}", env={**RL_ENV, LIMIT_ENV: f"update:0:{1 << 20}:1"}, timeout=900)
    msg = _assert_answer(r, "update", "rank 0 on node", run, args, None)
    assert "Out of device (GPU) memory" in msg and "CUDA out of memory" in msg
    shutil.rmtree(run, ignore_errors=True)


def test_a_process_killed_for_memory_is_told_apart_from_one_that_died(monkeypatch):
    """Ray's memory monitor's words, or a grown oom_kill count of the cgroup, make a lost rank an
    OOM answer; a plain crash (SIGKILL by hand, a node lost) stays a lost rank."""
    from engine.memory import oom

    said = ("1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.2, "
            "ID: ab12) where the lease was running was 30.1GB / 31.3GB (0.96), which exceeds the memory usage "
            "threshold of 0.95.")
    assert oom.killed_for_memory(said, 0).startswith("killed by Ray's memory monitor: 1 worker(s) were killed")
    monkeypatch.setattr(oom, "cgroup_oom_kills", lambda: 3)
    assert oom.killed_for_memory("The actor died unexpectedly before finishing this task.", 2) == \
        "killed by the kernel's OOM killer: this cgroup's oom_kill count went 2 -> 3"
    assert oom.killed_for_memory("The actor died unexpectedly before finishing this task.", 3) == ""
    assert oom.killed_for_memory("The actor died unexpectedly before finishing this task.", None) == ""
    monkeypatch.setattr(oom, "cgroup_oom_kills", lambda: None)   # no readable cgroup: nothing is claimed
    assert oom.killed_for_memory("worker exited with SIGKILL", 0) == ""


@pytest.mark.slow
def test_a_rank_that_rays_memory_monitor_kills_is_the_oom_answer(tmp_path):
    """A private local Ray whose memory monitor kills above 2 % of the node's memory (the rank is
    killed as soon as it runs): exit 2 with the OOM answer naming the phase, the rank and who
    killed it, not a traceback of ray.exceptions.OutOfMemoryError (what it was) or 'rank lost'."""
    env = {**RL_ENV, "RAY_memory_usage_threshold": "0.02", "RAY_memory_monitor_refresh_ms": "50"}
    r = rl("train", *TINY, "trainer.total_steps=2", f"checkpoint.dir={tmp_path / 'run'}", env=env,
           pre="import os\nos.environ.pop('RAY_ADDRESS', None)", timeout=600)
    out = flat(r.stdout + r.stderr)
    assert r.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert "Out of host memory in" in out and "on rank 0" in out and "killed by Ray's memory monitor" in out, out
    assert "Top fix from the memory estimate" in out
