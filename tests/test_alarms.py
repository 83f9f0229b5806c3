"""Alarms (engine/algorithms/alarms.py): each fires on a constructed run and stays quiet on
the default job's real records; trainer.stop_on_alarm stops a real run with a checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.algorithms.alarms import AlarmMonitor
from engine.config.schema import AlarmsConfig

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
    r = subprocess.run([sys.executable, "-m", "rlcli.main", "train", "trainer.total_steps=6",
                        "data.train_batch_size=8", "checkpoint.save_freq=0", f"checkpoint.dir={d}",
                        "trainer.stop_on_alarm=true", "alarms.entropy_min=100", "alarms.entropy_steps=2",
                        "alarms.entropy_reward_max=2", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["stopped_by_alarm"] == "entropy_collapse" and s["last_step"] == 2
    assert [a["kind"] for a in s["alarms"]] == ["entropy_collapse"]
    assert (d / "step_2" / "manifest.json").exists()
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2] and rows[1]["alarms"][0]["kind"] == "entropy_collapse"
    assert "ALARM" in r.stderr and "entropy_collapse" in r.stderr
