"""What every logger implements. The fan-out (fanout.py) calls these from one thread, in
step order, in bursts: every step and sample row queued since the last burst, then
``flush`` (hand what the logger still holds to its library); ``close`` at the run's end.
The constructor gets the run directory and where a resume continues (``LoggerContext``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class LoggerContext:
    run_dir: Path
    run_name: str
    project: str
    config: dict                 # the resolved config (asdict(RunConfig))
    resume_step: int | None      # the checkpoint's step on `rl resume`, None for a new run
    logged_through: int = -1     # highest step a previous segment of this run logged (-1: none)


class Logger:
    name = "logger"

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_samples(self, step: int, rows: list[dict]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """End of a burst: send what this logger batched (MLflow); a no-op for the others."""

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError


SAMPLE_COLUMNS = ("step", "prompt", "response", "reward", "advantage", "answer")
