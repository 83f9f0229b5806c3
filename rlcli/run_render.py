"""Shared by `rl train` and `rl resume`: run the trainer and render its events."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from rlcli.output import (call_engine, interrupts_reported_by_caller, print_json, print_json_error,
                          print_json_or_error, stderr_console, stdout_console)


def render_config(loaded, json_out: bool, report=None) -> None:
    from engine.config.interpolation import keep_env_references
    from engine.config.load import flatten

    shown = keep_env_references(asdict(loaded.config), loaded.env_refs)  # environment values are not shown
    if json_out:
        print_json_or_error({"config": shown, "groups": loaded.groups,
                             "changed": {k: list(v) for k, v in loaded.changed.items()}}
                            | ({"preflight": report.to_json()} if report is not None else {}),
                            *([report.raise_if_failed] if report is not None else []))
        return
    from rich.table import Table
    from rich.text import Text

    t = Table(title="resolved config (dry run)", title_justify="left")
    t.add_column("key", style="cyan")
    t.add_column("value")
    t.add_column("default", style="dim")
    for k, v in flatten(shown).items():
        if k in loaded.changed:
            t.add_row(k, Text(str(v), style="yellow"), Text(str(loaded.changed[k][0])))
        else:
            t.add_row(k, Text(str(v)), "")
    console = stdout_console()
    console.print(t)
    if report is not None:
        from rlcli.render.preflight import preflight_table

        console.print(preflight_table(report))


@contextmanager
def stdout_to_stderr(on: bool):
    """Under --json, stdout holds the JSON document only: whatever else the run writes there (a
    reward function's print, a library's, a spawned reward worker's) goes to stderr. At the file
    descriptor, so child processes started meanwhile inherit it."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved, stdout = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr  # also when sys.stdout is not fd 1 (an embedding program, a test runner)
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stdout = stdout
        os.dup2(saved, 1)
        os.close(saved)


def run_and_render(cfg, *, overrides, changed, json_out: bool, resume=None, env_refs=None) -> None:
    from rlcli.render.progress import LiveArea, StepBar
    from rlcli.render.train import PhaseDisplay, StepPrinter, plan_table, summary_chart, summary_table

    from engine.events import (Notice, PhaseFinished, PhaseProgress, PhaseStarted, RunPlan, RunProgress,
                                       RunSummary, StepRecord, Validation)
    from engine.trainer.trainer import train

    out = stderr_console() if json_out else stdout_console()  # under --json only the summary JSON goes to stdout
    area = LiveArea(out)  # a terminal's live bottom: phase spinners and the step bar (nothing on a pipe)
    console_on = "console" in cfg.trainer.loggers
    printer = StepPrinter(out, cfg.trainer.log_freq, enabled=console_on, area=area)
    phases = PhaseDisplay(out, area)
    bar = StepBar(area, enabled=console_on)

    def on_event(e) -> None:
        if isinstance(e, RunProgress):
            bar.update(e)
        elif isinstance(e, PhaseStarted):
            phases.started(e)
        elif isinstance(e, PhaseProgress):
            phases.update(e)
        elif isinstance(e, PhaseFinished):
            phases.finished(e)
        elif isinstance(e, RunPlan):
            out.print(plan_table(e))
        elif isinstance(e, StepRecord):
            printer.step(e)
        elif isinstance(e, Validation):
            printer.validation(e)
        elif isinstance(e, RunSummary):
            bar.close()  # the bar is erased; the summary stays
            out.print(summary_table(e))
            chart = summary_chart(e.run_dir, out)
            if chart is not None:
                out.print(chart)
        elif isinstance(e, Notice):
            from rich.markup import escape

            from engine.secret_values import redact

            out.print(f"[yellow]note[/]: {escape(redact(e.text))}")

    # Ctrl-C: let the trainer's finally-blocks stop the workers and Ray, then exit 130; SIGTERM
    # the same from here on (before Ray starts too: the ML stack's imports take seconds)
    from engine.sigterm import sigterm_as_exit

    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigterm_as_exit():
            try:
                def run():
                    with stdout_to_stderr(json_out):  # restored before call_engine prints an error's JSON
                        return train(cfg, Path(cfg.checkpoint.dir), overrides=overrides, changed=changed,
                                     on_event=on_event, resume=resume, env_refs=env_refs)

                with interrupts_reported_by_caller():
                    summary = call_engine(run)
            finally:
                bar.close()
                phases.close()
    except SystemExit as e:  # SIGTERM during the run (engine/trainer/ray_cluster.py): stopped like Ctrl-C
        from engine.sigterm import TERMINATED_EXIT

        if e.code != TERMINATED_EXIT:
            raise
        _stopped(cfg, "terminated (SIGTERM)", TERMINATED_EXIT)
    except KeyboardInterrupt:
        _stopped(cfg, "interrupted", 130)
    if json_out:
        print_json(summary.to_json())


def _stopped(cfg, how: str, code: int) -> None:
    """A run stopped by a signal (Ctrl-C, SIGTERM): the workers and Ray are already stopped; say
    where it can continue from and exit with ``code``."""
    import typer

    from engine.checkpoint.layout import latest_complete

    latest = latest_complete(Path(cfg.checkpoint.dir))
    where = (f"latest complete checkpoint: {latest.path} (continue with `rl resume {cfg.checkpoint.dir}`)"
             if latest else "no checkpoint had been saved yet")
    print_json_error(f"{how}: workers and Ray stopped; {where}.", how, code)
    stderr_console().print(f"[red]{how}[/]: workers and Ray stopped; {where}.")
    raise typer.Exit(code)
