"""The preflight report (engine.trainer.preflight.PreflightReport) as a table."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

_MARK = {True: Text("ok", style="green"), False: Text("FAILED", style="bold red"), None: Text("skipped", style="dim")}


def preflight_table(report) -> Table:
    """Each check and note; a value read from the environment shows as its `${oc.env:NAME}`."""
    from engine.secret_values import redact

    t = Table(title="preflight", title_justify="left")
    t.add_column("check", style="cyan")
    t.add_column("")
    t.add_column("detail")
    for c in report.checks:
        t.add_row(c.name, _MARK[c.ok], Text(redact(c.detail)))
    for n in report.notes:
        t.add_row("note", Text("!", style="yellow"), Text(redact(n)))
    return t
