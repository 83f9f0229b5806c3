"""`rl plot`: draw a metric of one or several runs from their metrics files."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

EPILOG = """[bold]Examples[/]

  rl plot ckpt/                                   [dim]# train/reward of one run, in the terminal[/]
  rl plot ckpt/ other_run/ --metric val/accuracy  [dim]# two runs side by side[/]
  rl plot ckpt/ --metric perf/step_time_s --png step_time.png
  rl plot ckpt/ --json                            [dim]# the series, for scripts[/]
  rl plot sync/ ahead/ --x version                [dim]# a sync and a one_step_off run, by policy[/]

Metric names: train/ (reward, accuracy, kl, clip_frac, rollout_kl, grad_norm, lr, advantage_*,
response_len_*, ...), val/ (reward, accuracy), perf/ (step_time_s, time/<phase>, tokens/s), mem/.
`rl plot ckpt/ --list` shows what a run has. --x version draws each point at the policy version
that sampled its batch (a run that samples ahead trains at step k on a batch of an older policy);
--x time at the training time through its step. Details: docs/tracking.md."""


def complete_path(incomplete: str):
    from rlcli.completion_keys import complete_ckpt_path_described

    return complete_ckpt_path_described(incomplete)


def register(app: typer.Typer) -> None:
    @app.command("plot", epilog=EPILOG, rich_help_panel="Inspect")
    def plot(
        runs: Annotated[list[str], typer.Argument(
            help="Run directories (checkpoint.dir of runs); a step_N directory or a metrics.jsonl also works.",
            show_default=False, autocompletion=complete_path)],
        metric: Annotated[str, typer.Option(
            "--metric", "-m", help="Metric to draw, e.g. train/reward, val/accuracy, perf/step_time_s.",
            rich_help_panel="Plot")] = "train/reward",
        png: Annotated[Optional[str], typer.Option(
            "--png", help="Also write the chart to this PNG file (matplotlib).", rich_help_panel="Output",
            show_default=False)] = None,
        list_metrics: Annotated[bool, typer.Option(
            "--list", help="List the metrics the runs hold instead of plotting.", rich_help_panel="Plot")] = False,
        width: Annotated[int, typer.Option("--width", help="Terminal chart width (columns, at least 20); 0 = the terminal's.",
                                           rich_help_panel="Plot", min=0)] = 0,
        height: Annotated[int, typer.Option("--height", help="Terminal chart height (rows).",
                                            rich_help_panel="Plot", min=5)] = 18,
        x_axis: Annotated[str, typer.Option(
            "--x", help="X axis: step; version (the policy version that sampled each batch, to compare a run "
            "that samples ahead with a synchronous one); time (training time, the sum of step times).",
            rich_help_panel="Plot", autocompletion=lambda: ["step", "version", "time"])] = "step",
        json_out: Annotated[bool, typer.Option(
            "--json", help="Print the series (steps and values per run) as JSON on stdout; no chart.",
            rich_help_panel="Output")] = False,
    ) -> None:
        """Draw a metric of one or several runs (terminal chart, or a PNG with --png)."""
        from pathlib import Path

        from rlcli.output import call_engine, fail, json_errors, print_json, stdout_console
        from rlcli.render.plot import MIN_WIDTH

        from engine.tracking.series import available_metrics, load_series
        json_errors(json_out)

        console = stdout_console()

        if list_metrics:
            found = {r: call_engine(available_metrics, Path(r)) for r in runs}
            if json_out:
                print_json({"metrics": found})
            else:
                from rich.markup import escape

                for r, names in found.items():  # paths and names as they are, never read as markup (`runs/[a]`)
                    console.print(f"[bold]{escape(r)}[/]: {escape(', '.join(names))}")
            return
        if 0 < width < MIN_WIDTH and not json_out:  # before any reading: the chart would be empty or unreadable
            fail(f"--width {width} is too narrow for a chart: its axes and tick labels alone take up to 9 columns. "
                 f"Give --width {MIN_WIDTH} or more, or 0 (the default) for the terminal's width.",
                 title="invalid option")
        if png:  # before any reading: a typo must never replace a user's file (metrics.jsonl) or a device
            from engine.user_paths import PNG_MAGIC, check_output_file

            call_engine(check_output_file, Path(png), "--png", magic=PNG_MAGIC, kind="PNG image")
        series = [call_engine(load_series, Path(r), metric, x_axis) for r in runs]
        name = series[0].metric
        written = None
        if png:
            from rlcli.render.plot import png_chart

            written = str(call_engine(png_chart, series, name, Path(png)))
        if json_out:
            print_json({"metric": name, "x_axis": x_axis, "runs": [s.to_json() for s in series], "png": written})
            return
        from rich.text import Text

        from rlcli.render.plot import terminal_chart

        w = width or min(max(console.width, 40), 120)
        chart = call_engine(terminal_chart, series, name, width=w, height=height, color=console.is_terminal)
        console.print(Text.from_ansi(chart) if console.is_terminal else Text(chart))
        if written:
            console.print(Text(f"wrote {written}"))
