"""`rl env`: the versions that matter for a bug report, as a table or JSON."""

from __future__ import annotations

from typing import Annotated

import typer

EPILOG = """[bold]Examples[/]

  rl env                      [dim]# python, torch + CUDA/GPUs, megatron-core, TE, vLLM, Ray, transformers, ...[/]
  rl env --json               [dim]# the same as JSON, to paste into an issue or diff against a run's versions.json[/]
  rl env --json | jq .versions
  rl env --no-torch           [dim]# skip importing torch (no CUDA/GPU rows), e.g. when torch itself is broken[/]"""


def register(app: typer.Typer) -> None:
    @app.command("env", epilog=EPILOG, rich_help_panel="Inspect",
                 help="Show the versions that matter for a bug report: python, torch, CUDA, megatron-core, "
                      "Transformer-Engine, vLLM, Ray, transformers, hydra-core, typer, rich, rl.")
    def env(
        json_out: Annotated[bool, typer.Option(
            "--json", help="Print the report as JSON on stdout.", rich_help_panel="Output")] = False,
        probe_torch: Annotated[bool, typer.Option(
            "--torch/--no-torch", help="Import torch to report the CUDA build, driver, GPUs, cuDNN and NCCL.",
            rich_help_panel="Output")] = True,
    ) -> None:
        from rich.markup import escape
        from rich.table import Table
        from rich.text import Text

        from engine.env_info import collect
        from rlcli.output import call_engine, json_errors, print_json, stdout_console
        json_errors(json_out)

        console = stdout_console()

        report = call_engine(collect, probe_torch=probe_torch)
        if json_out:
            print_json(report.to_json())
            return
        table = Table(title="rl environment", title_justify="left", show_lines=False)
        table.add_column("component", style="bold")
        table.add_column("version")
        table.add_column("detail", style="dim", overflow="fold")
        for c in report.components:
            # versions, paths and variables are shown as they are, never read as markup (OMP_NUM_THREADS='[/]')
            table.add_row(escape(c.name), escape(c.version) if c.version is not None else "[dim]not installed[/]",
                          escape(c.detail))
        console.print(table)
        plat = report.platform
        console.print(Text(f"platform: {plat.get('system', '')} {plat.get('release', '')} {plat.get('machine', '')}, "
                           f"{plat.get('cpus', '?')} CPUs" + (f" ({plat['usable_cpus']} usable by this process)"
                           if plat.get("usable_cpus") not in (None, plat.get("cpus")) else "") + (f", {plat['memory']}" if "memory" in plat else "")))
        if report.environment:
            console.print(Text("environment: " + " ".join(f"{k}={v}" for k, v in report.environment.items())))
