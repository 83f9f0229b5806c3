"""The loggers `trainer.loggers` may name, the package each needs, and the check that runs
when the config is validated (so a missing package stops the run before anything starts)."""

from __future__ import annotations

import importlib.util
import os

from engine.errors import ConfigError

EXTRA_HINT = "pip install 'rl[tracking]'"

# name -> the importable module it needs (None: nothing beyond rl itself)
LOGGERS: dict[str, str | None] = {
    "console": None,        # the CLI's step rows
    "jsonl": None,          # metrics.jsonl in the run directory
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}


def missing_module(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def check_loggers(loggers: list, *, installed: bool = True) -> None:
    """Raise ConfigError for an unknown logger name or (``installed``) one whose package is not
    installed on this machine."""
    from engine.config.validate import suggest

    for name in loggers:
        if not isinstance(name, str) or name not in LOGGERS:
            hint = suggest(name.lower(), list(LOGGERS)) if isinstance(name, str) else ""  # JSONL -> jsonl
            raise ConfigError(
                f"`trainer.loggers` names an unknown logger {name!r}.{hint} Loggers are: {', '.join(LOGGERS)}, "
                f"e.g. trainer.loggers=[console,jsonl,tensorboard].", title="invalid config value")
    if len(set(loggers)) != len(loggers):
        raise ConfigError(f"`trainer.loggers` lists a logger twice: {list(loggers)}.", title="invalid config value")
    missing = [n for n in loggers if installed and LOGGERS[n] and missing_module(LOGGERS[n])]
    if missing:
        what = ", ".join(f"{n} (needs the `{LOGGERS[n]}` package)" for n in missing)
        raise ConfigError(
            f"trainer.loggers asks for {what}, which is not installed. Install the tracking extra: "
            f"`{EXTRA_HINT}`, or drop {', '.join(missing)} from trainer.loggers.", title="missing package")


WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb.Settings(mode=) takes
WANDB_PROJECT_CHARS = "/\\#?%:"   # characters wandb refuses in a project name
WANDB_PROJECT_MAX = 128


def check_logger_options(loggers: list, project: str) -> None:
    """What wandb and MLflow would refuse when they open, checked with the config: WANDB_MODE
    and trainer.project. They open in the fan-out's thread while the ranks start, so before
    this a typo there stopped the run only after the model was built, at its first event."""
    from engine.config.validate import suggest

    project = str(project)
    if "wandb" in loggers:
        mode = os.environ.get("WANDB_MODE")
        if mode and mode not in WANDB_MODES:
            raise ConfigError(
                f"WANDB_MODE={mode!r} is not a wandb mode.{suggest(mode.lower(), list(WANDB_MODES))} wandb takes "
                f"{', '.join(WANDB_MODES[:3])} (or {', '.join(WANDB_MODES[3:])}); unset WANDB_MODE to log offline "
                "unless W&B is configured (docs/tracking.md).", title="invalid logger setting")
        bad = sorted({c for c in project if c in WANDB_PROJECT_CHARS})
        if bad or len(project) > WANDB_PROJECT_MAX:
            why = (f"contains {' '.join(repr(c) for c in bad)}" if bad else
                   f"is {len(project)} characters long (at most {WANDB_PROJECT_MAX})")
            raise ConfigError(
                f"`trainer.project` {project!r} {why}, which wandb refuses as a project name (no "
                f"{' '.join(WANDB_PROJECT_CHARS)}, at most {WANDB_PROJECT_MAX} characters). Pick another, e.g. "
                f"trainer.project=my-project.", title="invalid config value")
    if "mlflow" in loggers and not project.strip():
        raise ConfigError("`trainer.project` is empty, and MLflow needs an experiment name (trainer.project is "
                          "it). Set one, e.g. trainer.project=rl (the default).", title="invalid config value")
