"""`rl mem-report`: where memory goes in an RL step, estimated and measured, and how to fit."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

EPILOG = """[bold]Examples[/]

  rl mem-report                                   [dim]# run ONE step of the embedded default job and report it[/]
  rl mem-report data.train_batch_size=4           [dim]# one step of that job (overrides as in rl train)[/]
  rl mem-report ckpt/                             [dim]# what a run recorded (its memory.jsonl) vs the estimate[/]
  rl mem-report --estimate model.path=/models/Qwen2.5-7B --engine megatron engine.tensor_model_parallel_size=4 trainer.nprocs=8
  rl mem-report --estimate model.path=llama-70b trainer.nprocs=8 --device-memory 80GiB
  rl mem-report ckpt/ --json | jq '.estimate.offload_matrix'

--estimate builds the model on the meta device: no weights, no GPU, nothing downloaded.
Built-in architectures for model.path: llama-7b, llama-13b, llama-70b, llama3-8b, llama3-70b.
Megatron keys (engine.tensor_model_parallel_size...) need [bold]--engine megatron[/]. Details: docs/memory.md."""


def complete_engine(incomplete: str):
    from rlcli.completion_keys import engine_options

    return [e for e in engine_options() if e.startswith(incomplete)]


def complete_override(incomplete: str):
    from rlcli.completion_keys import complete_override as _complete

    return _complete(incomplete)


def _is_run_path(arg: str) -> bool:
    from pathlib import Path

    return "=" not in arg or Path(arg).expanduser().exists()


def _extra_after_run(args: list[str], engine: Optional[str]) -> str:
    """What to do instead of `rl mem-report RUN EXTRA...`: a second run is reported in its own
    command; overrides or --engine belong to an estimate (which takes no run directory)."""
    from shlex import quote as shell_quote

    runs = [a for a in args[1:] if "=" not in a]
    changes = [a for a in args[1:] if "=" in a] + ([f"--engine {engine}"] if engine else [])
    if runs and not changes:
        each = "; ".join(f"`rl mem-report {shell_quote(a)}`" for a in args)
        return (f"`rl mem-report` reports one run directory at a time, and got {len(args)}: "
                f"{', '.join(shell_quote(a) for a in args)}. Report each in its own command: {each}.")
    extra = " ".join(runs + changes)
    fix = (f"To estimate a changed config instead: `rl mem-report --estimate {' '.join(changes)}` (the "
           f"default config with these changes; add the run's own overrides to estimate it).")
    if runs:
        fix += f" Another run is reported in its own command: `rl mem-report {shell_quote(runs[0])}`."
    return f"`{extra}`: a run directory is reported as it ran, so it takes no overrides or --engine. {fix}"


def register(app: typer.Typer) -> None:
    @app.command("mem-report", epilog=EPILOG, rich_help_panel="Inspect")
    def mem_report(
        args: Annotated[Optional[list[str]], typer.Argument(
            help="A run directory (reads its memory.jsonl), or key=value overrides of the job to run one step of "
                 "(or to estimate, with --estimate). Nothing: one step of the default job.",
            metavar="RUN_DIR | KEY=VALUE", show_default=False, autocompletion=complete_override)] = None,
        estimate: Annotated[bool, typer.Option(
            "--estimate", help="Estimate only, from the config (meta-device model): run nothing, load no weights.",
            rich_help_panel="Mode")] = False,
        engine: Annotated[Optional[str], typer.Option(
            "--engine", "-e", help="Training backend for the job: fsdp or megatron (same as engine=<name>).",
            autocompletion=complete_engine, rich_help_panel="Mode")] = None,
        device_memory: Annotated[Optional[str], typer.Option(
            "--device-memory", metavar="SIZE",
            help="Device memory per rank to check fits against, e.g. 80GiB, 141GB (default: this machine's GPU, "
                 "or the run's recorded device).", rich_help_panel="Device")] = None,
        json_out: Annotated[bool, typer.Option(
            "--json", help="Print the report as JSON on stdout (same facts as the tables).",
            rich_help_panel="Output")] = False,
    ) -> None:
        """Memory per phase and category: estimate beside measured, offload what-if, FP8 workspaces, fixes."""
        from rlcli.output import (call_engine, fail, interrupts_reported_by_caller, json_errors, print_json,
                                  stderr_console, stdout_console)
        from rlcli.render.mem_report import render_report

        from engine.memory import measure
        json_errors(json_out)

        console, err_console = stdout_console(), stderr_console()

        args = list(args or [])
        if estimate and args and "=" not in args[0]:
            from pathlib import Path

            if Path(args[0]).expanduser().exists():  # "not an override" did not say what to do instead
                fail(f"`{args[0]}` is a path, and --estimate takes key=value overrides of a config, not a run. "
                     f"To report that run (its memory.jsonl beside the estimate of its config): `rl mem-report "
                     f"{args[0]}`, without --estimate.", title="invalid arguments")
        if estimate:
            rep = call_engine(measure.estimate_only, args, engine=engine, device_memory=device_memory)
        elif args and _is_run_path(args[0]):
            if len(args) > 1 or engine:
                fail(_extra_after_run(args, engine), title="invalid arguments")
            rep = call_engine(measure.report_from_run, args[0], device_memory=device_memory)
        else:
            call_engine(measure.check_one_step, args, engine=engine, device_memory=device_memory)  # fail early
            what = "the default job" if not args else " ".join(args)
            err_console.print(f"[dim]running one RL step of {what} in a temporary directory "
                              "(real trainer; about a minute on CPU)...[/]")
            try:
                from engine.trainer.memory_run import measure_default

                with interrupts_reported_by_caller():
                    rep = call_engine(measure_default, args, engine=engine, device_memory=device_memory)
            except KeyboardInterrupt:
                err_console.print("[red]interrupted[/]: the step's workers and Ray were stopped; nothing was kept.")
                raise typer.Exit(130)
        if json_out:
            print_json(rep.to_json())
        else:
            render_report(rep, console)
