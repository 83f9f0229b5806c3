"""engine.max_tokens_per_micro_batch=0: the budget fitted to the memory a rank has.

The fit is checked against the estimate it serves (the chosen budget's estimated peak is within
the allowed share of the device, one more sequence would not be), for monotony in the device's
size and for its refusal; and a real `rl train` on this CPU shows the fitted budget in its plan
and splits its update into micro-batches that keep to it."""

from __future__ import annotations

import json

import pytest

from engine.config.load import load_run_config
from engine.errors import UserError
from engine.memory.estimate import estimate_memory, model_structure
from engine.env_info import host_available_bytes
from engine.memory.micro_batch_fit import _estimate_at, fit_token_budget, shared_worker_bytes
from tests.cli_utils import flat, rl

GiB = 1 << 30
SMOLLM2 = ["model.preset=smollm2-135m", "model.dtype=bfloat16", "data.train_batch_size=8",
           "rollout.max_new_tokens=512", "engine.max_tokens_per_micro_batch=0"]


def _cfg(*overrides):
    return load_run_config(list(overrides)).config


@pytest.mark.parametrize("device_gib", [4, 8, 16, 40])
def test_fitted_budget_is_the_largest_whose_estimated_peak_fits(device_gib):
    """At the fitted k sequences the estimated peak is within fraction x device; at k + 1 it is
    not (unless k is the whole mini-batch): the largest budget that fits, not merely one that does."""
    cfg = _cfg(*SMOLLM2)
    st = model_structure(cfg)
    fit = fit_token_budget(cfg, st, device_gib * GiB)
    limit = int(device_gib * GiB * cfg.engine.micro_batch_memory_fraction)
    assert fit.limit_bytes == limit and fit.tokens == fit.micro_seqs * fit.seq_len == fit.micro_seqs * 576
    assert _estimate_at(st, cfg, fit.micro_seqs, None, "sdpa")["peak"].total == fit.peak_bytes <= limit
    if fit.whole_mini_batch:
        assert fit.micro_seqs == 64  # 8 prompts x 8 samples
    else:
        assert _estimate_at(st, cfg, fit.micro_seqs + 1, None, "sdpa")["peak"].total > limit


def test_more_memory_never_fits_less_and_plenty_fits_the_mini_batch():
    cfg = _cfg(*SMOLLM2)
    st = model_structure(cfg)
    budgets = [fit_token_budget(cfg, st, g * GiB).tokens for g in (4, 6, 8, 12, 16, 24, 32, 48, 80)]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]
    assert fit_token_budget(cfg, st, 200 * GiB).whole_mini_batch


def test_the_estimate_shows_the_budget_it_would_fit():
    """`rl mem-report --estimate ... --device-memory` of a budget-0 config estimates at the fitted
    budget and says so; without a device size it shows 4096 tokens and says why."""
    cfg = _cfg(*SMOLLM2)
    est = estimate_memory(cfg, device_memory_bytes=16 * GiB)
    fit = fit_token_budget(cfg, model_structure(cfg), 16 * GiB)
    assert est.assumptions["micro_batch_tokens"] == fit.tokens and est.peak_bytes == fit.peak_bytes
    assert any("fits this device at" in n for n in est.notes)
    unknown = estimate_memory(cfg, device_memory_bytes=None)
    assert unknown.assumptions["micro_batch_tokens"] == 7 * 576  # 4096 // 576 sequences
    assert any("--device-memory" in n for n in unknown.notes)


def test_a_device_too_small_for_one_sequence_is_refused_with_the_fix():
    cfg = _cfg(*SMOLLM2)
    with pytest.raises(UserError) as e:
        fit_token_budget(cfg, model_structure(cfg), 1 * GiB)
    msg = e.value.message
    assert "one sequence of 576 tokens" in msg and "engine.micro_batch_memory_fraction" in msg
    assert "rl mem-report" in msg


def test_a_rollout_worker_sharing_the_first_ranks_gpu_is_taken_out_before_the_fit():
    """A mode that samples ahead with no GPU free for the rollout worker puts it on the first
    rank's GPU, where it holds its own copy of the policy, its KV cache (vLLM: its pool, a share of
    the whole device) and logits while that rank updates. It starts after the ranks fitted their
    budget, so the fit takes it out of the free memory: at least the worker's weights (torch) or
    gpu_memory_utilization x the device (vLLM's pool holds the weights), and in sync none."""
    total = 80 * GiB
    sync = _cfg(*SMOLLM2)
    st = model_structure(sync)
    assert shared_worker_bytes(sync, st, total) == 0
    ahead = _cfg(*SMOLLM2, "trainer.mode=one_step_off")
    weights = st.total * 2  # bf16
    torch_worker = shared_worker_bytes(ahead, st, total)
    assert torch_worker > weights
    vllm = _cfg(*SMOLLM2, "trainer.mode=one_step_off", "rollout=vllm", "rollout.gpu_memory_utilization=0.3")
    assert shared_worker_bytes(vllm, st, total) >= 0.3 * total
    # 40 GiB free less the worker (vLLM's 24 GiB pool and its logits) fits fewer sequences, and says so
    worker = shared_worker_bytes(vllm, st, total)
    alone, shared = fit_token_budget(vllm, st, 40 * GiB), fit_token_budget(vllm, st, 40 * GiB, worker_bytes=worker)
    assert shared.tokens < alone.tokens and shared.peak_bytes <= shared.limit_bytes
    assert shared.limit_bytes == int((40 * GiB - worker) * vllm.engine.micro_batch_memory_fraction)
    assert "rollout worker sharing this GPU" in shared.describe() and "rollout worker" not in alone.describe()
    with pytest.raises(UserError) as e:  # no room left for one sequence: the worker and its fixes named
        fit_token_budget(vllm, st, worker + GiB // 4, worker_bytes=worker)
    assert "rollout worker sharing this GPU" in e.value.message and "lower rollout.gpu_memory_utilization" in e.value.message


@pytest.mark.slow
def test_a_cpu_run_fits_its_budget_and_keeps_to_it(tmp_path):
    """A real run on this CPU: the host's available memory is the rank's; a fraction that allows
    the estimated peak of ~16 of the mini-batch's 256 sequences at the longest length (76 tokens)
    makes the fit land far below the whole batch, so the update (real rows are much shorter)
    splits into several micro-batches, none over the fitted budget. A
    fraction too small for one sequence stops the run at start-up: exit 2, one paragraph."""
    args = ["trainer.total_steps=1", "engine.max_tokens_per_micro_batch=0"]
    cfg = _cfg(*args)
    st = model_structure(cfg, vocab_size=None)
    frac = _estimate_at(st, cfg, 16, None, "sdpa")["peak"].total / host_available_bytes()
    r = rl("train", *args, f"engine.micro_batch_memory_fraction={frac:.6g}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = flat(r.stdout)
    assert "engine.max_tokens_per_micro_batch" in out and "(fitted:" in out
    budget = int(out.split("engine.max_tokens_per_micro_batch ")[1].split(" (fitted")[0])
    row = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[0])
    shapes = row["micro_batch_shapes"]
    assert len(shapes) > 1 and all(rows * length <= budget for rows, length in shapes), (budget, shapes)

    (tmp_path / "small").mkdir()
    r = rl("train", *args, "engine.micro_batch_memory_fraction=1e-9", cwd=tmp_path / "small")
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert "even one sequence" in flat(r.stderr + r.stdout)
