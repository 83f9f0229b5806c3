"""Where the CLI writes: rich consoles, JSON, and one-paragraph errors on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, TypeVar

from rich.console import Console
from rich.panel import Panel

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

T = TypeVar("T")


def print_json(obj: Any) -> None:
    """JSON for scripts: to stdout, nothing else on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, title: str = "error", exit_code: int = 2) -> None:
    """Print a one-paragraph error to stderr and exit (no traceback)."""
    import typer

    from rich.markup import escape

    # messages are plain text: "rl[tracking]" or "[console,jsonl]" must not be read as markup
    err_console.print(Panel(escape(message), title=f"[bold red]{title}[/]", title_align="left",
                            border_style="red", expand=False))
    raise typer.Exit(exit_code)


def call_engine(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run an engine entry point, turning its UserError into a clean exit 2."""
    from engine.errors import UserError

    try:
        return fn(*args, **kwargs)
    except UserError as e:
        fail(e.message, title=e.title, exit_code=e.exit_code)
        raise  # unreachable
