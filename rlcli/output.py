"""Where the CLI writes: rich consoles, JSON, and one-paragraph errors on stderr."""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

from rich.console import Console
from rich.panel import Panel



def stdout_console() -> Console:
    """A console on stdout, sized from the terminal (or COLUMNS) as it is now. Built when a
    command runs, never at import: rich fixes a console's width from COLUMNS when the console
    is made, so one made at import would keep that width for every later command in the
    same process (an embedding program, a test runner)."""
    return Console(highlight=False)


def stderr_console() -> Console:
    """A console on stderr (progress, notes and errors that must not mix with --json on stdout)."""
    return Console(stderr=True, highlight=False)

T = TypeVar("T")


def strict_json_value(obj: Any) -> Any:
    """``obj`` with every non-finite float (nan, inf) replaced by None: standard JSON has no
    NaN/Infinity, and strict parsers (jq, JSON.parse, Go) reject them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json_value(v) for v in obj]
    return obj


# --json: whether the running command was asked for JSON, and whether it already printed its one
# JSON document. A command with --json that fails before that prints {"error": {...}} on stdout
# (besides the panel on stderr), so stdout is always one valid JSON document.
_json_state = {"on": False, "printed": False}


def json_state() -> dict:
    """Whether a command asked for JSON (``on``) and already printed its document (``printed``)."""
    return dict(_json_state)


def json_errors(on: bool) -> None:
    """Called first by every command that takes --json (a process may run several commands)."""
    _json_state.update(on=bool(on), printed=False)


def print_json(obj: Any) -> None:
    """JSON for scripts: to stdout, nothing else on stdout; always standard JSON; no value read from
    the environment (engine/secret_values.py)."""
    from engine.secret_values import env_values, redact_all

    text = json.dumps(strict_json_value(obj), indent=2, default=str, allow_nan=False)
    if env_values():
        text = json.dumps(redact_all(json.loads(text)), indent=2, allow_nan=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    _json_state["printed"] = True


def print_json_error(message: str, title: str, exit_code: int) -> None:
    """Under --json, when no JSON document was printed yet: the error as one on stdout."""
    if _json_state["on"] and not _json_state["printed"]:
        print_json({"error": {"title": str(title), "message": str(message), "exit_code": exit_code}})


def print_json_or_error(doc: dict, *checks: Callable[[], None]) -> None:
    """Under --json, a --dry-run's document (the plan, the resolved config) whose ``checks`` (each
    raises UserError, e.g. ``plan.raise_if_refused``) may still refuse it: a refused one is printed
    with the first refusal under "error" ({"error": {title, message, exit_code}, ...the document}),
    so every error follows the {"error": ...} convention and the plan stays readable. The caller
    then runs the same checks through call_engine, which shows the panel and exits."""
    from engine.errors import UserError
    from engine.secret_values import redact

    for check in checks:
        try:
            check()
        except UserError as e:
            doc = {"error": {"title": redact(str(e.title)), "message": redact(str(e.message)),
                             "exit_code": e.exit_code}} | doc
            break
    print_json(doc)


def fail(message: str, title: str = "error", exit_code: int = 2) -> None:
    """Print a one-paragraph error to stderr and exit (no traceback). The message and title
    are plain text: brackets such as `rl[smollm2]` are shown, never read as rich markup. A value
    read from the environment is shown as its `${oc.env:NAME}` (engine/secret_values.py)."""
    import typer
    from rich.text import Text

    from engine.secret_values import redact

    message, title = redact(str(message)), redact(str(title))

    print_json_error(message, title, exit_code)
    stderr_console().print(Panel(Text(str(message)), title=Text(str(title), style="bold red"), title_align="left",
                            border_style="red", expand=False))
    raise typer.Exit(exit_code)


_OWN_INTERRUPTS = [0]  # > 0: a caller reports Ctrl-C itself (a run: where to resume from)


@contextmanager
def interrupts_reported_by_caller():
    """Within the block, call_engine lets KeyboardInterrupt through to a caller that says more."""
    _OWN_INTERRUPTS[0] += 1
    try:
        yield
    finally:
        _OWN_INTERRUPTS[0] -= 1


def call_engine(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run an engine entry point, turning its UserError into a clean exit 2 (and Ctrl-C into exit
    130 with one line, or one JSON document under --json)."""
    from engine.errors import UserError

    try:
        return fn(*args, **kwargs)
    except UserError as e:
        fail(e.message, title=e.title, exit_code=e.exit_code)
        raise  # unreachable
    except KeyboardInterrupt:
        if _OWN_INTERRUPTS[0]:
            raise
        fail("stopped by Ctrl-C before the command finished; run it again for its result.", title="interrupted",
             exit_code=130)
        raise  # unreachable
    except OSError as e:  # the last net: a path the OS refused (one no check foresaw) is never a traceback
        if not e.filename:  # not about a path (a socket, a timeout, a broken pipe): not the user's input
            raise
        from engine.user_paths import os_problem, shown

        fail(f"{shown(e.filename)} {os_problem(e)}. Check that the path exists, is the kind of file the command expects "
             "(a directory or a regular file) and that you may read it (or write where an output goes).",
             title="file error")
        raise  # unreachable
