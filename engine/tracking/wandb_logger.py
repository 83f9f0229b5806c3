"""Weights & Biases through ``wandb``: offline (a run directory under ``<run_dir>/wandb/``,
uploadable later with ``wandb sync``) unless the user configured W&B: ``WANDB_MODE`` set, or
an API key (``WANDB_API_KEY`` or a ``api.wandb.ai`` entry in ~/.netrc). Never prompts.

The run id is kept in tracking.json, so `rl resume` continues the same run (``resume="allow"``).
W&B histories only grow: steps a previous segment already logged are not sent again."""

from __future__ import annotations

import netrc
import os
import uuid

from engine.tracking.base import SAMPLE_COLUMNS, Logger, LoggerContext
from engine.tracking.state import read_state, update_state


def wandb_mode() -> str:
    """offline unless the user configured W&B (WANDB_MODE, or an API key)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        if netrc.netrc().authenticators(host):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class WandbLogger(Logger):
    name = "wandb"

    def __init__(self, ctx: LoggerContext):
        import wandb

        self._wandb = wandb
        run_id = read_state(ctx.run_dir).get("wandb_run_id") or uuid.uuid4().hex[:8]
        self.skip_through = ctx.logged_through
        self.run = wandb.init(
            project=ctx.project, name=ctx.run_name, id=run_id, resume="allow", dir=str(ctx.run_dir),
            mode=wandb_mode(), config=ctx.config, reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False))
        update_state(ctx.run_dir, wandb_run_id=run_id, wandb_project=ctx.project)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if step > self.skip_through:
            self.run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        if step > self.skip_through:
            table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r.get(c) for c in SAMPLE_COLUMNS]
                                                                         for r in rows])
            self.run.log({"samples": table}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
