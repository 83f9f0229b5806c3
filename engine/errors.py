"""Errors a user can act on. The CLI prints their message (one paragraph) and exits 2.

A message never shows a value read from the environment: each one seen while a config
resolved is replaced by its `${oc.env:NAME}` (engine/secret_values.py)."""

from __future__ import annotations

from engine.secret_values import redact


class UserError(Exception):
    """Bad input: a config value, a path, a checkpoint that cannot be used.

    The message names the problem and the fix. The CLI shows it without a traceback and
    exits with ``exit_code``.
    """

    exit_code = 2

    def __init__(self, message: str, *, title: str = "error"):
        message = redact(message)
        super().__init__(message)
        self.message = message
        self.title = redact(title)


class ConfigError(UserError):
    """A config key or value that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, unsafe or incompatible."""


class EnvironmentFailed(UserError):
    """A multi-turn environment (task.environment) raised during a rollout (engine/agents/loop.py)."""

    def __init__(self, message: str):
        super().__init__(message, title="environment failed")
