"""``Tracking``: the trainer hands it every event; it fans them out to the configured loggers.

metrics.jsonl and samples.jsonl are written in the caller's thread (they are the run's own
record and must be on disk before the step's checkpoint). TensorBoard, wandb and MLflow run
in one background thread, fed by a queue in step order: opening them (imports, wandb's
service, MLflow's database) overlaps with the ranks starting, and their per-step cost stays
off the training loop. The thread works in bursts: it waits BURST_S seconds after the first
event of a burst, then hands every logger all the steps queued meanwhile and flushes them
(MLflow: one SQL transaction for the burst). So the loggers wake every few seconds, not at
every step boundary, when the ranks pick their thread count for the next phase
(engine/threads.adapt_threads counts the runnable tasks). ``wait_idle`` and ``close`` end a
burst at once; ``close`` (also after a failed or interrupted run) drains the queue, so every
queued step reaches every logger exactly once. An error in a logger is raised in the
trainer's thread at the next event (or at close) as a UserError naming the logger.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict
from pathlib import Path

from engine.errors import UserError
from engine.tracking.base import Logger, LoggerContext
from engine.tracking.jsonl_logger import JsonlLogger
from engine.tracking.names import step_metrics, validation_metrics
from engine.tracking.samples import append_samples
from engine.events import PhaseFinished, Samples, StepRecord, Validation

BACKGROUND = ("tensorboard", "wandb", "mlflow")
BURST_S = 5.0   # the loggers get a step at most this many seconds after it ends (and at close)
PHASE_METRICS = ("save_checkpoint", "validation")  # phases whose time is logged as perf/time/<phase>


def open_logger(name: str, ctx: LoggerContext) -> Logger:
    if name == "tensorboard":
        from engine.tracking.tensorboard_logger import TensorBoardLogger
        return TensorBoardLogger(ctx)
    if name == "wandb":
        from engine.tracking.wandb_logger import WandbLogger
        return WandbLogger(ctx)
    if name == "mlflow":
        from engine.tracking.mlflow_logger import MlflowLogger
        return MlflowLogger(ctx)
    raise ValueError(name)


class Tracking:
    def __init__(self, cfg, run_dir: Path, *, resume_step: int | None = None, logged_through: int = -1,
                 burst_s: float = BURST_S):
        run_dir = Path(run_dir)
        self.burst_s = burst_s
        self.run_dir = run_dir
        names = list(cfg.trainer.loggers)
        self.jsonl = JsonlLogger(run_dir) if "jsonl" in names else None
        self.sample_log = cfg.trainer.sample_log_freq > 0
        self.ctx = LoggerContext(run_dir=run_dir, run_name=run_dir.resolve().name, project=cfg.trainer.project,
                                 config=asdict(cfg), resume_step=resume_step, logged_through=logged_through)
        self.background = [n for n in names if n in BACKGROUND]
        self.loggers: list[Logger] = []
        self.sync_s = 0.0          # seconds spent in on_event (the trainer's thread)
        self.background_s = 0.0    # seconds the logger thread spent logging (after opening)
        self._error: BaseException | None = None
        self._error_logger = ""
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        self._closed = False
        if self.background:
            self._thread = threading.Thread(target=self._run, name="rl-tracking", daemon=True)
            self._thread.start()

    # ---- the trainer's side ----------------------------------------------------------------
    def on_event(self, e) -> None:
        t0 = time.perf_counter()
        self._raise_pending()
        if isinstance(e, StepRecord):
            row = e.to_json()
            if self.jsonl is not None:
                self.jsonl.write_step(row)
            self._put("metrics", e.step, step_metrics(row))
            if e.samples:
                self._samples(Samples(e.step, e.samples))
        elif isinstance(e, Samples):
            self._samples(e)
        elif isinstance(e, Validation):
            self._put("metrics", e.step, validation_metrics(e.accuracy, e.reward))
        elif isinstance(e, PhaseFinished) and e.phase in PHASE_METRICS and e.step is not None:
            m = {f"perf/time/{e.phase}": e.seconds}
            if e.bytes is not None and e.phase == "save_checkpoint":
                m["perf/checkpoint_bytes"] = float(e.bytes)
            self._put("metrics", e.step, m)
        self.sync_s += time.perf_counter() - t0

    def _samples(self, e: Samples) -> None:
        if self.sample_log:
            append_samples(self.run_dir, e.rows)
        self._put("samples", e.step, e.rows)

    def close(self, failed: bool = False, timeout_s: float = 120.0) -> None:
        """Flush and close every logger; raises a logger's error unless the run already failed."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(("close", failed, None))
            self._thread.join(timeout_s)
        if not failed:
            self._raise_pending()

    def stats(self) -> dict:
        return {"tracking_sync_s": self.sync_s, "tracking_background_s": self.background_s,
                "loggers": (["jsonl"] if self.jsonl else []) + list(self.background), "where": self.where()}

    def where(self) -> dict[str, str]:
        """Where each logger wrote, for the summary."""
        out = {}
        if self.jsonl is not None:
            out["jsonl"] = str(self.jsonl.path)
        for name in self.background:
            if name == "tensorboard":
                from engine.tracking.tensorboard_logger import LOG_SUBDIR
                out[name] = f"{self.run_dir / LOG_SUBDIR}  (tensorboard --logdir {self.run_dir / LOG_SUBDIR})"
            elif name == "wandb":
                from engine.tracking.wandb_logger import wandb_mode
                mode = wandb_mode()
                out[name] = f"{mode}, {self.run_dir / 'wandb'}" + (
                    f"  (upload: wandb sync {self.run_dir / 'wandb'}/offline-run-*)" if mode == "offline" else "")
            elif name == "mlflow":
                from engine.tracking.mlflow_logger import tracking_uri
                out[name] = f"{tracking_uri(self.run_dir)}  (mlflow ui --backend-store-uri {tracking_uri(self.run_dir)})"
        return out

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        """Block until the logger thread has handled everything queued so far."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put(("idle", 0, done))
        return done.wait(timeout_s)

    def _put(self, kind: str, step: int, payload) -> None:
        if self._thread is not None:
            self._queue.put((kind, step, payload))

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise UserError(f"The {self._error_logger} logger failed: {type(err).__name__}: {err}. Drop it from "
                            f"trainer.loggers to run without it.", title="logging failed") from err

    # ---- the logger thread -----------------------------------------------------------------
    def _run(self) -> None:
        for name in self.background:
            try:
                self.loggers.append(open_logger(name, self.ctx))
            except BaseException as err:  # noqa: BLE001 - reported in the trainer's thread
                self._fail(name, err)
                break
        while True:
            burst = self._next_burst()
            kind, step, payload = burst[-1]
            self._log(burst if kind in ("metrics", "samples") else burst[:-1])
            if kind == "idle":
                payload.set()
            elif kind == "close":
                for lg in self.loggers:
                    try:
                        lg.close(failed=bool(step))
                    except BaseException as err:  # noqa: BLE001
                        self._fail(lg.name, err)
                return

    def _next_burst(self) -> list:
        """Block for the next event, then collect what arrives within BURST_S; an ``idle`` or
        ``close`` message ends the burst at once (it is the burst's last item)."""
        burst = [self._queue.get()]
        deadline = time.monotonic() + self.burst_s
        while burst[-1][0] not in ("idle", "close"):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                burst.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        return burst

    def _log(self, events: list) -> None:
        """Every event of a burst to every logger, in order, then each logger's flush."""
        if self._error is not None or not events:
            return  # a logger failed: drain until close
        t0 = time.perf_counter()
        for lg in self.loggers:
            try:
                for kind, step, payload in events:
                    if kind == "metrics":
                        lg.log_metrics(step, payload)
                    else:
                        lg.log_samples(step, payload)
                lg.flush()
            except BaseException as err:  # noqa: BLE001
                self._fail(lg.name, err)
                break
        self.background_s += time.perf_counter() - t0

    def _fail(self, name: str, err: BaseException) -> None:
        if self._error is None:
            self._error, self._error_logger = err, name
