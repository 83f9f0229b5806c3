"""`rl train`'s first steps are GRPO written from the formulas, step after step: a whole run, not
one update.

tests/test_update_parity.py checks one update on a fixed batch; tests/test_sampling_parity.py
checks what the sampler draws. What neither sees is how the steps compose: the optimizer's state
carried from step to step, the learning-rate schedule, the prompt order, the rewards computed from
the decoded responses, each group's advantages, and the sampler reading the weights the last update
wrote. Here a real ``rl train`` (FSDP2 on one gloo rank, in a Ray actor) runs four steps of
bench/learning.py's ``count`` job, and bench/reference_grpo.py's plain loop (no rl trainer code)
runs the same four steps: Hugging Face model, AdamW, gradient clipping, GRPO's group-normalised
advantages, the token-mean PPO-clip loss, and the prompt order rl documents (its run seed shuffles
the prompt file, then each epoch's order: docs/data.md). The reference draws with rl's sampler on
its own copy of the weights (the sampler's distribution is the other test's subject), from the
generator rl seeds for rank 0.
So if any step of rl's trainer differed from the formulas, the weights would differ after it, and
every later batch, reward and gradient with them. The second test does the same for
``trainer.mode=one_step_off`` against bench/delayed_grpo.py (the loop with each batch sampled one
version behind, as rl's rollout worker samples it).

Measured when written (2026-12-05): rewards and lengths equal, pre-clip gradient norms and entropies
within 7e-7 relative over the four steps (hence the 2e-5 tolerance). Sensitivity: rl with AdamW's
beta2 at 0.99 instead of the reference's 0.999 gives the same samples for four steps but gradient
norms off by 8e-5 at step 3 and 4.5e-3 at step 4. The 3.4M-parameter ``count`` job of
bench/learning.py agreed over its first 3 steps the same way (docs/benchmarks.md, "Learning").
one_step_off (2026-12-06): equal samples, equal clip fractions (10 %, 8 % and 4 % of the tokens
clipped at steps 2-4), gradient norms within 5e-7 relative; with ``algorithm.behavior_clip=fixed``
rl clips 29 % at step 2 and its gradient norm there is 4 % off the loop's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_utils import rl
from tests.learning_job import count_job
STEPS, NEW_TOKENS, LR, SEED = 4, 16, 3e-3, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return count_job(tmp_path_factory, "trajectory")


def rl_steps(work: Path, job_dir: Path, run_dir: Path, *extra: str) -> list[dict]:
    from bench.learning import rl_overrides

    r = rl("train", *rl_overrides(job_dir, work / "model", SEED, STEPS, loss="token-mean", new_tokens=NEW_TOKENS),
           f"optim.lr={LR}", "trainer.threads_per_rank=1", "checkpoint.save_final=false", f"checkpoint.dir={run_dir}",
           *extra, cwd=job_dir)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_rl_train_steps_equal_grpo_from_the_formulas(job, tmp_path):
    import torch

    from bench.reference_grpo import reference_run

    work, job_dir = job
    got = rl_steps(work, job_dir, tmp_path / "run")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as rl's rank
        want = reference_run(job_dir, work / "model", SEED, STEPS, lr=LR, new_tokens=NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)  # the rest of this test worker's tests keep theirs
    assert len(got) == STEPS
    assert want[0]["response_len_mean"] > 8, "the start must have long responses and spread rewards"
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g["response_len_mean"] == w["response_len_mean"], f"step {step}: other responses were sampled"
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], abs=1e-6), f"step {step}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=2e-5), f"step {step}: {g['grad_norm']} vs {w['grad_norm']}"
        assert g["entropy"] == pytest.approx(w["entropy"], rel=2e-5), f"step {step}"
    # the steps moved the policy: the later batches are the updated weights' (not the first step's again)
    assert len({round(w["grad_norm"], 6) for w in want}) == STEPS


def test_rl_one_step_off_steps_equal_delayed_grpo_from_the_formulas(job, tmp_path):
    """trainer.mode=one_step_off is the same loop with step k+1's batch sampled by the weights before
    step k's update (rl's rollout worker, its own generator), PPO's ratio against those weights and
    the clip's bounds compounded for one version (bench/delayed_grpo.py's ``behavior``). Checked step
    for step, so a lag in learning is the delay's, not a defect of the path that samples ahead (a
    batch sampled with other weights, a wrong version, a clip against the wrong log-probs)."""
    import torch

    from bench.delayed_grpo import delayed_run

    work, job_dir = job
    got = rl_steps(work, job_dir, tmp_path / "run", "trainer.mode=one_step_off")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = delayed_run(job_dir, work / "model", SEED, STEPS, "behavior", lr=LR, new_tokens=NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)
    assert [g["staleness"].get("rows_1", 0) for g in got] == [0] + [64] * (STEPS - 1)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g["response_len_mean"] == w["response_len_mean"], f"step {step}: other responses were sampled"
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], abs=1e-6), f"step {step}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=2e-5), f"step {step}: {g['grad_norm']} vs {w['grad_norm']}"
        assert g["clip_frac"] == pytest.approx(w["clip_frac"], abs=1e-6), f"step {step}"
    assert max(w["kl_to_sampler"] for w in want[1:]) > 0, "the stale batches must differ from the trained weights"
