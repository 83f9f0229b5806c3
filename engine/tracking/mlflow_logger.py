"""MLflow through ``MlflowClient``: the server or store named by ``MLFLOW_TRACKING_URI`` when
set, else a SQLite store inside the run directory (``<run_dir>/mlflow.db``, artifacts under
``<run_dir>/mlartifacts/``). MLflow 3 refuses its old ``./mlruns`` file store by default; a
SQLite file is its recommended local store and needs no server.

The run id is kept in tracking.json, so `rl resume` continues the same MLflow run. MLflow
metric histories only grow: steps a previous segment already logged are not sent again.
Metrics go to MLflow in one ``log_batch`` per burst of the fan-out (every few seconds, and at
close; at most BATCH_LIMIT rows per call): each SQL transaction costs more than the rows in it
(12 ms of CPU per step one step at a time, ~3 ms batched; what is left is ~75 us per row in
MLflow's SQLAlchemy store, whatever the batch size)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from engine.tracking.base import Logger, LoggerContext
from engine.tracking.state import read_state, update_state

DB_FILE = "mlflow.db"
BATCH_LIMIT = 1000     # MLflow's limit of metrics per log_batch
ARTIFACT_DIR = "mlartifacts"


def tracking_uri(run_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(run_dir) / DB_FILE).resolve()}"


def disable_telemetry() -> None:
    """MLflow 3 sends usage telemetry to its servers from a background thread (set up when
    ``mlflow`` is imported) unless ``MLFLOW_DISABLE_TELEMETRY`` or ``DO_NOT_TRACK`` says not to.
    A run's loggers stay local unless the user asked otherwise (wandb is offline unless
    configured), so rl turns it off unless the user set either variable."""
    if "MLFLOW_DISABLE_TELEMETRY" not in os.environ and "DO_NOT_TRACK" not in os.environ:
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out |= flat_params(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = str(v)[:6000]
    return out


class MlflowLogger(Logger):
    name = "mlflow"

    def __init__(self, ctx: LoggerContext):
        for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(name).setLevel(logging.WARNING)
        disable_telemetry()
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self._Metric = Metric
        self.uri = tracking_uri(ctx.run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.skip_through = ctx.logged_through
        state = read_state(ctx.run_dir)
        run_id = state.get("mlflow_run_id")
        if state.get("mlflow_tracking_uri") != self.uri and os.environ.get("MLFLOW_TRACKING_URI"):
            run_id = None  # another server or store than the run's: a new run there
        # The run's own store (mlflow.db in the run directory) holds the id also after the directory
        # was moved or copied (the saved URI names the old path: each resume started a new MLflow
        # run holding only the new steps); a deleted or replaced mlflow.db no longer holds it (a
        # failed update_run stopped the run): then a new run.
        if run_id and not self._holds(run_id):
            run_id = None
        if run_id:
            if state.get("mlflow_tracking_uri") != self.uri:  # the run directory moved: its store's new path
                update_state(ctx.run_dir, mlflow_tracking_uri=self.uri)
            self.client.update_run(run_id, status="RUNNING")
            # what MLflow itself holds (a kill can lose the last unflushed batch that metrics.jsonl has)
            held = self.client.get_metric_history(run_id, "train/reward")
            self.skip_through = max((m.step for m in held), default=-1)
        else:
            exp = self.client.get_experiment_by_name(ctx.project)
            if exp is not None:
                exp_id = exp.experiment_id
            elif os.environ.get("MLFLOW_TRACKING_URI"):
                exp_id = self.client.create_experiment(ctx.project)
            else:
                exp_id = self.client.create_experiment(
                    ctx.project, artifact_location=(ctx.run_dir / ARTIFACT_DIR).resolve().as_uri())
            run = self.client.create_run(exp_id, run_name=ctx.run_name, tags={"rl.run_dir": str(ctx.run_dir)})
            run_id = run.info.run_id
            params = [Param(k, v) for k, v in flat_params(ctx.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i:i + 100])
            update_state(ctx.run_dir, mlflow_run_id=run_id, mlflow_tracking_uri=self.uri,
                         mlflow_experiment_id=exp_id)
        self.run_id = run_id
        self._pending: list = []

    def _holds(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if step > self.skip_through:
            now = int(time.time() * 1000)
            self._pending += [self._Metric(k, v, now, step) for k, v in metrics.items()]

    def flush(self) -> None:
        """The burst's rows in as few log_batch calls as MLflow takes (BATCH_LIMIT rows each)."""
        while self._pending:
            chunk = self._pending[:BATCH_LIMIT]
            self.client.log_batch(self.run_id, metrics=chunk)
            del self._pending[:len(chunk)]  # only once MLflow has them: a failed call keeps its rows

    def log_samples(self, step: int, rows: list[dict]) -> None:
        if step > self.skip_through:
            self.client.log_dict(self.run_id, rows, f"samples/step_{step:06d}.json")

    def close(self, failed: bool = False) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
