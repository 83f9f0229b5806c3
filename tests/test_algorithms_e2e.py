"""The algorithm presets through the real `rl train` (Ray, gloo, the tiny model)."""

from __future__ import annotations

import json

import pytest

from tests.cli_utils import rl as run_rl


def rl(*args, timeout=600):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, timeout=timeout)


@pytest.mark.slow
def test_dapo_dynamic_sampling_trains_full_batches(tmp_path):
    """algorithm=dapo: every step trains exactly train_batch_size x rollout_n rows, whatever
    share of groups dynamic sampling dropped, and reports its rounds and the overlong penalty."""
    d = tmp_path / "run"
    r = rl("train", "algorithm=dapo", "trainer.total_steps=3", "data.train_batch_size=8",
           f"checkpoint.dir={d}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        a = row["algo"]
        assert a["batch_rows"] == 8 * 8
        assert a["dynamic_sampling_rounds"] >= 1 and a["dynamic_sampling_prompts_drawn"] >= 8
        assert a["overlong_penalty"] <= 0


@pytest.mark.slow
def test_reinforce_pp_runs_with_kl_in_the_reward(tmp_path):
    """algorithm=reinforce_pp builds the reference, puts k1 KL into the token reward and
    reports it as the step's kl."""
    d = tmp_path / "run"
    r = rl("train", "algorithm=reinforce_pp", "trainer.total_steps=3", "data.train_batch_size=8",
           f"checkpoint.dir={d}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert all(row["kl"] is not None for row in rows)
    assert "name: reinforce_pp" in (d / "config.yaml").read_text()
