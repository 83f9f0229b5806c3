"""The driver keeps nothing per step for the whole run (issue 47, item 6: a long run's memory
stays flat; bench/soak.py measures it, docs/benchmarks.md "Soak").

The soak found the driver growing ~11 KB a step: the trainer kept every StepRecord (memory
records, shapes, timings) only to compute the summary's first-10 and last-10 reward means, and
the alarm monitor kept every step's reward to read the last ``alarms.window`` of them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.algorithms.alarms import AlarmMonitor
from engine.config.schema import AlarmsConfig
from tests.ray_procs import child_env


def test_alarm_monitor_keeps_only_its_window():
    m = AlarmMonitor(AlarmsConfig(window=10))
    for s in range(1, 501):
        m.observe({"step": s, "reward_mean": s / 500, "entropy": 1.0, "response_clip_frac": 0.1})
    assert len(m.rewards) == 10 and m.rewards[-1] == 1.0
    assert m.best_recent == pytest.approx(sum(range(491, 501)) / 500 / 10)  # the window's mean, as before


# a run in its own process: at each step's event, the StepRecords of steps two or more back are
# gone (only weak references held here); the summary's reward means still match metrics.jsonl
DRIVER = r"""
import gc, json, sys, weakref
from pathlib import Path
from engine.config.load import load_run_config
from engine.events import StepRecord
from engine.trainer.trainer import train

run = Path(sys.argv[1])
ov = ["trainer.total_steps=14", "data.train_batch_size=2", "algorithm.rollout_n=2", "checkpoint.save_final=false",
      f"checkpoint.dir={run}"]
cfg = load_run_config(ov).config
refs, alive = {}, []
def on_event(e):
    if isinstance(e, StepRecord):
        refs[e.step] = weakref.ref(e)
        gc.collect()
        alive.extend(s for s, r in refs.items() if s <= e.step - 2 and r() is not None)
summary = train(cfg, run, overrides=ov, on_event=on_event)
rewards = [json.loads(x)["reward_mean"] for x in (run / "metrics.jsonl").read_text().splitlines()]
print(json.dumps({"alive": sorted(set(alive)), "steps_run": summary.steps_run, "last_step": summary.last_step,
                  "first10": summary.reward_first10, "last10": summary.reward_last10,
                  "want_first10": sum(rewards[:10]) / 10, "want_last10": sum(rewards[-10:]) / 10}))
"""


@pytest.mark.slow
def test_the_driver_keeps_no_step_records(tmp_path):
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "run")], env=child_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["alive"] == [], f"StepRecords of these steps were still held: {got['alive']}"
    assert got["steps_run"] == 14 and got["last_step"] == 14
    assert got["first10"] == pytest.approx(got["want_first10"]) and got["last10"] == pytest.approx(got["want_last10"])
