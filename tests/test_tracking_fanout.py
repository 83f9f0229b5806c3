"""The fan-out's background loggers (engine/tracking/fanout.py) with the real libraries: they
work in bursts, a close (at the run's end, or after a crash) hands them every queued step
exactly once, and an error in one of them reaches the trainer's thread as a UserError."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from wandb_records import history  # noqa: E402

from engine.errors import UserError  # noqa: E402

NEVER = 3600.0  # a burst that only ends at wait_idle or close


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")


def step(n: int, samples: bool = False):
    from engine.events import StepRecord

    rec = StepRecord(step=n, reward_mean=0.1 * n, accuracy=None, kl=None, pg_loss=-0.5, entropy=2.0, grad_norm=1.0,
                     lr=1e-3, response_len_mean=8.0, rollout_tokens_per_s=1e4, update_tokens_per_s=1e4,
                     step_time_s=0.2, peak_mem_bytes=1 << 20, pad_fraction=0.1, distinct_shapes=1,
                     timing={"rollout": 0.1, "update": 0.1})
    if samples:
        rec.samples = [{"step": n, "prompt": "p", "response": "r", "reward": 1.0, "advantage": 0.5, "answer": "a"}]
    return rec


def tracking(tmp_path: Path, loggers: list[str]):
    from engine.config.validate import build_run_config
    from engine.tracking.fanout import Tracking

    cfg = build_run_config({"trainer": {"loggers": loggers}})
    return Tracking(cfg, tmp_path, burst_s=NEVER)


def mlflow_client(run: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")


def mlflow_steps(run: Path, metric: str = "train/reward") -> list[int]:
    run_id = json.loads((run / "tracking.json").read_text())["mlflow_run_id"]
    return sorted(m.step for m in mlflow_client(run).get_metric_history(run_id, metric))


def test_a_crash_stop_close_hands_every_queued_step_to_every_logger_once(tmp_path, offline):
    """Steps queued in a burst that has not ended (the loggers have none of them yet) all reach
    TensorBoard, wandb and MLflow exactly once when the run stops on an error
    (close(failed=True)); MLflow marks the run FAILED."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = tracking(tmp_path, ["jsonl", "tensorboard", "wandb", "mlflow"])
    t.wait_idle()  # the loggers are open
    for n in range(1, 8):
        t.on_event(step(n, samples=n % 3 == 0))
    assert mlflow_steps(tmp_path) == []  # the burst is still open: nothing sent per step
    t.close(failed=True)

    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/reward")] == list(range(1, 8))
    assert [e.value for e in ea.Scalars("train/reward")] == pytest.approx([0.1 * n for n in range(1, 8)])

    assert mlflow_steps(tmp_path) == list(range(1, 8))
    state = json.loads((tmp_path / "tracking.json").read_text())
    assert mlflow_client(tmp_path).get_run(state["mlflow_run_id"]).info.status == "FAILED"

    hist = [h for f in tmp_path.glob("wandb/offline-run-*/run-*.wandb") for h in history(f)]
    assert Counter(h["_step"] for h in hist if "train/reward" in h) == Counter({n: 1 for n in range(1, 8)})
    assert sorted(h["_step"] for h in hist if "samples" in h) == [3, 6]


def test_wait_idle_ends_a_burst_and_flushes(tmp_path, offline):
    """wait_idle hands the loggers what is queued and flushes them (MLflow's batch is in the
    store), without waiting for the burst's time to run out; later steps go in the next burst."""
    t = tracking(tmp_path, ["mlflow"])
    for n in (1, 2):
        t.on_event(step(n))
    assert t.wait_idle(timeout_s=120)
    assert mlflow_steps(tmp_path) == [1, 2]
    t.on_event(step(3))
    t.close()
    assert mlflow_steps(tmp_path) == [1, 2, 3]


def test_an_error_while_logging_reaches_the_trainer_as_a_user_error(tmp_path, offline):
    """MLflow's run is deleted under the logger: the burst's log_batch fails, and the trainer's
    next event raises a UserError naming the logger (not a dead thread and a silent gap)."""
    t = tracking(tmp_path, ["mlflow"])
    t.on_event(step(1))
    t.wait_idle()
    run_id = json.loads((tmp_path / "tracking.json").read_text())["mlflow_run_id"]
    mlflow_client(tmp_path).delete_run(run_id)
    t.on_event(step(2))
    t.wait_idle()
    with pytest.raises(UserError) as e:
        t.on_event(step(3))
    assert "mlflow logger failed" in e.value.message
    t.close(failed=True)  # the run already failed: close does not raise again


def test_an_error_in_the_final_flush_is_raised_by_close(tmp_path, offline):
    """The last burst is sent at close; if the logger fails there, close raises the UserError."""
    t = tracking(tmp_path, ["mlflow"])
    t.wait_idle()
    run_id = json.loads((tmp_path / "tracking.json").read_text())["mlflow_run_id"]
    mlflow_client(tmp_path).delete_run(run_id)
    t.on_event(step(1))
    with pytest.raises(UserError) as e:
        t.close()
    assert "mlflow logger failed" in e.value.message


def test_step_row_holds_every_field_but_memory_and_samples():
    """StepRecord.to_json (the metrics.jsonl row) leaves out memory and samples and copies the
    rest: a later change to the record does not change a row already taken."""
    rec = step(4, samples=True)
    rec.memory = [{"rank": 0, "phase": "update", "rss": 1}]
    row = rec.to_json()
    expected = asdict(rec)
    expected.pop("memory")
    expected.pop("samples")
    assert row == expected and list(row) == list(expected)
    rec.timing["rollout"] = 9.0
    assert row["timing"]["rollout"] == 0.1


def test_mlflow_logger_keeps_mlflow_telemetry_off_unless_the_user_chose(tmp_path, monkeypatch):
    """Opening the MLflow logger in a plain process (no pytest or CI variables, which MLflow
    itself treats as "no telemetry") leaves MLflow's usage telemetry disabled, so a run sends
    nothing to MLflow's servers; a user's own setting of either variable is kept."""
    import os
    import subprocess

    from engine.tracking.mlflow_logger import disable_telemetry

    code = ("import sys; from pathlib import Path; from engine.tracking.base import LoggerContext; "
            "from engine.tracking.mlflow_logger import MlflowLogger; "
            "lg = MlflowLogger(LoggerContext(Path(sys.argv[1]), 'x', 'p', {}, None)); lg.close(); "
            "from mlflow.telemetry.client import get_telemetry_client; "
            "from mlflow.telemetry.utils import is_telemetry_disabled; "
            "print(is_telemetry_disabled(), get_telemetry_client() is None)")
    ci = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "MLFLOW_TRACKING_URI", "MLFLOW_DISABLE_TELEMETRY",
          "DO_NOT_TRACK")
    env = {k: v for k, v in os.environ.items() if k not in ci}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "True"]

    for var, value in (("MLFLOW_DISABLE_TELEMETRY", "false"), ("DO_NOT_TRACK", "false")):
        monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
        monkeypatch.delenv("DO_NOT_TRACK", raising=False)
        monkeypatch.setenv(var, value)
        disable_telemetry()
        assert os.environ[var] == value and ("MLFLOW_DISABLE_TELEMETRY" in os.environ) == (var == "MLFLOW_DISABLE_TELEMETRY")
