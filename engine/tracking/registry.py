"""The loggers `trainer.loggers` may name, the package each needs, and the check that runs
when the config is validated (so a missing package stops the run before anything starts)."""

from __future__ import annotations

import importlib.util

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


def check_loggers(loggers: list) -> None:
    """Raise ConfigError for an unknown logger name or one whose package is not installed."""
    from engine.config.validate import suggest

    for name in loggers:
        if not isinstance(name, str) or name not in LOGGERS:
            hint = suggest(str(name), list(LOGGERS)) if isinstance(name, str) else ""
            raise ConfigError(
                f"`trainer.loggers` names an unknown logger {name!r}.{hint} Loggers are: {', '.join(LOGGERS)}, "
                f"e.g. trainer.loggers=[console,jsonl,tensorboard].", title="invalid config value")
    if len(set(loggers)) != len(loggers):
        raise ConfigError(f"`trainer.loggers` lists a logger twice: {list(loggers)}.", title="invalid config value")
    missing = [n for n in loggers if LOGGERS[n] and missing_module(LOGGERS[n])]
    if missing:
        what = ", ".join(f"{n} (needs the `{LOGGERS[n]}` package)" for n in missing)
        raise ConfigError(
            f"trainer.loggers asks for {what}, which is not installed. Install the tracking extra: "
            f"`{EXTRA_HINT}`, or drop {', '.join(missing)} from trainer.loggers.", title="missing package")
