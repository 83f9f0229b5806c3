"""Multi-turn rollouts sampled ahead of the update (trainer.mode=one_step_off with task=tool_add,
docs/async.md "Multi-turn rollouts"): the agent loop runs on the driver, each model turn sampled by
the rollout worker, the environment between turns.

The environment here is the built-in calculator behind a sandbox's latency (50 ms a call), so a
batch is still between turns when the ranks finish their update and the next weights are ready.
What must hold whatever the timing:

- every turn of a batch is sampled with the weights the schedule says (the version before the
  update it overlaps), checked token by token: the log-probs the worker recorded for a queued
  batch equal those the checkpointed weights of that version compute on the whole multi-turn rows,
  and differ from the next version's;
- a run resumed from a checkpoint continues exactly (the queued batch, its conversations and its
  environment's rewards are in the checkpoint);
- every sample after step 1 is one version old, and step 1's rows are recomputed exactly by the ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli_utils import rl

SLOW_ENV = '''
import time

from engine.agents.calculator_env import CalculatorEnvironment


class SlowCalculator(CalculatorEnvironment):
    """The built-in calculator environment, 50 ms a step (a sandbox's round trip)."""

    def begin(self, messages):
        time.sleep(0.05)
        return super().begin(messages)
'''
ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}
RUN = ["train", "task=tool_add", "task.environment=slow_env:SlowCalculator", "trainer.mode=one_step_off",
       "trainer.total_steps=4", "data.train_batch_size=4", "algorithm.rollout_n=4", "rollout.max_turns=3",
       "rollout.max_new_tokens=8", "trainer.threads_per_rank=1", "trainer.sample_log_freq=1",
       "checkpoint.save_freq=1", "checkpoint.keep_last=0"]
TRAINED = ("reward_mean", "pg_loss", "grad_norm", "entropy", "clip_frac", "response_len_mean", "staleness", "algo")


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("agents-ahead")
    (work / "slow_env.py").write_text(SLOW_ENV)
    r = rl(*RUN, f"checkpoint.dir={work / 'run'}", cwd=work, timeout=600, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work / "run"


def model_log_probs(model_dir: Path, batch: dict) -> torch.Tensor:
    """Each row's token log-probs under the exported model (temperature 1), at the token's position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for i in range(len(ids)):
        n = int(attn[i].sum())
        with torch.no_grad():
            logp = model(ids[i:i + 1, :n]).logits[0, :-1].float().log_softmax(-1)
        out[i, 1:n] = logp.gather(-1, ids[i, 1:n, None])[:, 0]
    return out


@pytest.mark.slow
def test_every_turn_of_a_queued_batch_comes_from_the_version_before_the_update(run, tmp_path):
    """step_2 was saved with step 3's batch queued: asked before step 2's update, so every turn of it
    must have been sampled with version 1 (step_1's weights), none with version 2 (step_2's), although
    version 2 reached the worker while those episodes were still between turns."""
    queue = torch.load(run / "step_2" / "rollout_queue.pt", weights_only=True)["queue"]
    assert len(queue) == 1 and queue[0]["stats"]["version"] == 1
    batch, agent = queue[0]["batch"], json.loads(queue[0]["agent"])
    turns = [sum(m["role"] == "assistant" for m in c) for c in agent["conversations"]]
    assert max(turns) >= 2, f"no trajectory took a second turn, so later turns go unchecked: {turns}"
    model = batch["response_mask"] > 0
    # the tokens of each row's second and later turns: model tokens after its first tool message
    later = model & (torch.cumsum((batch["response_mask"] == 0) & (batch["attention_mask"] > 0)
                                  & (torch.arange(model.shape[1]) >= batch["prompt_lengths"][:, None]), 1) > 0)
    assert later.any()
    exported = {}
    for step in (1, 2):
        r = rl("export", str(run / f"step_{step}"), "-o", str(tmp_path / f"hf{step}"), env=ENV)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        exported[step] = model_log_probs(tmp_path / f"hf{step}", batch)
    recorded = batch["rollout_log_probs"]
    assert (exported[1] - recorded)[model].abs().max() < 1e-4       # every model token: version 1
    assert (exported[2] - recorded)[later].abs().max() > 1e-2       # the check can tell the versions apart


@pytest.mark.slow
def test_samples_are_one_version_old_and_step_one_is_recomputed_exactly(run):
    r = rows(run)
    assert [x["staleness"]["policy_version"] for x in r] == [0, 1, 2, 3]
    assert r[0]["staleness"]["rows_0"] == 16
    assert all(x["staleness"]["rows_1"] == 16 for x in r[1:])
    # step 1: the worker sampled every turn with the weights the ranks recompute with
    assert r[0]["algo"]["rollout_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert r[0]["algo"]["rollout_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert all(1 <= x["algo"]["agent_turns_mean"] <= x["algo"]["agent_turns_max"] <= 3 for x in r)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["response"] == s["conversation"][-1]["content"] for s in samples)


@pytest.mark.slow
def test_a_resumed_multi_turn_run_continues_exactly(run, tmp_path):
    """Resumed from step_2: step 3 trains the checkpoint's queued episodes (scored again from their
    saved conversations and environment rewards), step 4 new ones; both equal the uninterrupted run."""
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    for step in (3, 4):
        shutil.rmtree(dst / f"step_{step}")
    shutil.copy(run.parent / "slow_env.py", tmp_path / "slow_env.py")
    r = rl("resume", str(dst), cwd=tmp_path, timeout=600, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = rows(run), rows(dst)
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:]):
        assert {k: x[k] for k in TRAINED} == {k: y[k] for k in TRAINED}, x["step"]
