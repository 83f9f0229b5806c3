"""Alarms (engine/algorithms/alarms.py): each fires on a constructed run and stays quiet on
the default job's real records; trainer.stop_on_alarm stops a real run with a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.algorithms.alarms import AlarmMonitor
from engine.config.schema import AlarmsConfig
from tests.cli_utils import rl

# metrics.jsonl of `rl train trainer.val_freq=10` (the embedded default job, 40 steps),
# trimmed to the fields the alarms read. Its responses drift to max_new_tokens (echo does not
# reward stopping) while the reward climbs 0.08 -> 0.995 and entropy falls to 0.047.
DEFAULT_JOB = Path(__file__).parent / "data" / "default_job_metrics.jsonl"


def row(step, reward=0.5, entropy=1.0, truncated=0.1, rollout_kl=0.0, val=None):
    return {"step": step, "reward_mean": reward, "entropy": entropy, "response_clip_frac": truncated,
            "rollout_kl": rollout_kl, "val_accuracy": val, "val_reward": None}


def run(rows, **cfg):
    m = AlarmMonitor(AlarmsConfig(**cfg))
    return [a for r in rows for a in m.observe(r)]


def test_quiet_on_the_default_job():
    rows = [json.loads(x) for x in DEFAULT_JOB.read_text().splitlines()]
    assert len(rows) == 40 and rows[-1]["entropy"] < 0.05 and rows[-1]["response_clip_frac"] > 0.9
    assert run(rows) == []


def test_entropy_collapse_fires_after_n_low_steps_below_the_reward_ceiling():
    rows = [row(s, reward=0.4, entropy=1.0) for s in range(1, 4)] + \
           [row(s, reward=0.4, entropy=0.01) for s in range(4, 12)]
    fired = run(rows, entropy_min=0.02, entropy_steps=5)
    assert [(a.kind, a.step) for a in fired] == [("entropy_collapse", 8)]  # 4,5,6,7,8: five in a row
    # the same entropy on a solved task (reward above entropy_reward_max) is not an alarm
    solved = [row(s, reward=0.99, entropy=0.01) for s in range(1, 12)]
    assert run(solved, entropy_min=0.02, entropy_steps=5) == []


def test_length_blowup_fires_when_truncation_rises_and_reward_falls():
    # the failure: the policy stops emitting EOS, every response hits the cap, reward halves
    rows = [row(s, reward=0.8, truncated=0.05) for s in range(1, 11)] + \
           [row(s, reward=0.4, truncated=1.0) for s in range(11, 16)]
    fired = run(rows, window=3)
    assert [(a.kind, a.step) for a in fired] == [("length_blowup", 11)]
    # rising truncation while reward rises (the default job) is not
    assert run([row(s, reward=0.1 * s, truncated=0.1 * s) for s in range(1, 10)], window=3) == []


def test_logprob_mismatch_fires_above_the_threshold():
    rows = [row(1, rollout_kl=1e-9), row(2, rollout_kl=0.2), row(3, rollout_kl=0.3), row(4, rollout_kl=0.0),
            row(5, rollout_kl=0.5)]
    fired = run(rows, rollout_kl_max=0.05)
    # fires when it starts, not again while it persists, and again after it cleared
    assert [(a.kind, a.step) for a in fired] == [("logprob_mismatch", 2), ("logprob_mismatch", 5)]


def test_no_signal_fires_after_n_steps_of_all_zero_advantages():
    def adv(step, lo, hi, zero_std=1.0):
        return {**row(step, reward=0.0), "adv_min": lo, "adv_max": hi, "algo": {"frac_reward_zero_std": zero_std}}

    rows = [adv(1, 0.0, 0.0), adv(2, -0.7, 1.2, 0.5), adv(3, 0.0, 0.0), adv(4, -0.0, 0.0), adv(5, 0.0, 0.0),
            adv(6, 0.0, 0.0), adv(7, -1.0, 1.0, 0.9), adv(8, 0.0, 0.0), adv(9, 0.0, 0.0), adv(10, 0.0, 0.0)]
    fired = run(rows, no_signal_steps=3)
    # three in a row (3, 4, 5), not again while it holds (6), again after it cleared (8, 9, 10)
    assert [(a.kind, a.step) for a in fired] == [("no_signal", 5), ("no_signal", 10)]
    assert "every prompt group's samples scored the same (mean reward 0.000)" in fired[0].message
    assert "algorithm.dynamic_sampling=true" in fired[0].message
    # rows without advantages (older metrics.jsonl files) and tiny non-zero advantages are not judged
    assert run([row(s) for s in range(1, 8)], no_signal_steps=1) == []
    assert run([adv(s, -1e-9, 1e-9, 0.0) for s in range(1, 8)], no_signal_steps=1) == []


def test_val_drop_fires_when_validation_falls_while_reward_rises():
    rows = [row(1, reward=0.3, val=0.6), row(2, reward=0.5), row(3, reward=0.7, val=0.5)]
    fired = run(rows, window=1, val_drop=0.05)
    assert [(a.kind, a.step) for a in fired] == [("val_drop", 3)]
    # validation falling together with the reward is a different problem: no val_drop alarm
    falling = [row(1, reward=0.7, val=0.6), row(2, reward=0.5), row(3, reward=0.3, val=0.5)]
    assert run(falling, window=1) == []


@pytest.mark.slow
def test_stop_on_alarm_stops_cleanly_with_a_checkpoint(tmp_path):
    """An entropy threshold no policy can meet makes the alarm fire at step 2; with
    trainer.stop_on_alarm=true the run ends there, saves step_2 and reports why."""
    d = tmp_path / "run"
    r = rl("train", "trainer.total_steps=6", "data.train_batch_size=8", "checkpoint.save_freq=0", f"checkpoint.dir={d}",
           "trainer.stop_on_alarm=true", "alarms.entropy_min=100", "alarms.entropy_steps=2", "alarms.entropy_reward_max=2",
           "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["stopped_by_alarm"] == "entropy_collapse" and s["last_step"] == 2
    assert [a["kind"] for a in s["alarms"]] == ["entropy_collapse"]
    assert (d / "step_2" / "manifest.json").exists()
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2] and rows[1]["alarms"][0]["kind"] == "entropy_collapse"
    assert "ALARM" in r.stderr and "entropy_collapse" in r.stderr


CONSTANT_REWARD = """
def always_zero(prompt, response, answer):
    # the classic silent failure: an answer key that never matches, so every sample scores 0
    return 0.0
"""


@pytest.mark.slow
def test_a_reward_that_scores_everything_the_same_raises_no_signal_and_stops(tmp_path):
    """A real run whose reward function returns 0 for everything: every group's samples score the
    same (frac_reward_zero_std 1, TRL's name), every advantage is 0, and after
    alarms.no_signal_steps steps the alarm fires and stop_on_alarm ends the run with a checkpoint.
    The default job's first steps, learning, raise nothing."""
    from tests.cli_utils import rl_concurrently

    rows_in = [{"prompt": f"say {w}:", "answer": w} for w in ["hi", "ok", "yes", "no"] * 4]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    (tmp_path / "zero.py").write_text(CONSTANT_REWARD)
    common = ["trainer.total_steps=8", "data.train_batch_size=4", "algorithm.rollout_n=4", "checkpoint.save_freq=0",
              "trainer.stop_on_alarm=true", "alarms.no_signal_steps=3", "trainer.threads_per_rank=1", "--json"]
    stuck, learning = rl_concurrently(
        ["train", "task=dataset", "task.path=train.jsonl", "task.reward_fn=zero:always_zero", "task.num_val=0",
         f"checkpoint.dir={tmp_path / 'stuck'}", *common],
        ["train", f"checkpoint.dir={tmp_path / 'learning'}", *common], cwd=tmp_path, timeout=600)
    assert stuck.returncode == 0, stuck.stderr[-3000:]
    s = json.loads(stuck.stdout)
    assert s["stopped_by_alarm"] == "no_signal" and s["last_step"] == 3, s
    assert (tmp_path / "stuck" / "step_3" / "manifest.json").exists()
    rows = [json.loads(x) for x in (tmp_path / "stuck" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["algo"]["frac_reward_zero_std"] == 1.0 and r["adv_min"] == r["adv_max"] == 0.0 for r in rows), rows
    assert "ALARM" in stuck.stderr and "no_signal" in stuck.stderr and "samples.jsonl" in stuck.stderr
    assert learning.returncode == 0, learning.stderr[-3000:]
    ok = json.loads(learning.stdout)
    assert ok["last_step"] == 8 and ok["stopped_by_alarm"] is None and ok["alarms"] == [], ok
    lrows = [json.loads(x) for x in (tmp_path / "learning" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["algo"]["frac_reward_zero_std"] < 1.0 for r in lrows), [r["algo"] for r in lrows]
