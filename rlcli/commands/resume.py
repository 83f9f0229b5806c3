"""`rl resume`: continue a run from its latest complete checkpoint (or a named one)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

EPILOG = """[bold]Examples[/]

  rl resume ckpt/                                 [dim]# latest complete checkpoint under ckpt/[/]
  rl resume ckpt/step_40                          [dim]# that one (newer ones are set aside, not deleted)[/]
  rl resume ckpt/ trainer.total_steps=200         [dim]# extend the run[/]
  rl resume ckpt/ trainer.nprocs=1                [dim]# saved with 2 ranks, resumed with 1 (DCP reshards)[/]
  rl resume ckpt/ --dry-run                       [dim]# print what would be restored; load nothing[/]
  rl resume ckpt/ --dry-run --json                [dim]# the same plan as JSON[/]
  rl resume ckpt/ --no-verify                     [dim]# skip content hashes (huge checkpoints; said in red)[/]

Allowed changes: trainer.total_steps, trainer.nprocs, logging/validation cadence, checkpoint.save_freq/
keep_last, memory settings (offload, micro-batches). Refused: model.*, task.*, data.*, optim.*, algorithm.*,
engine.name, trainer.seed, sampling settings. Every file is verified against the content hashes in the
manifest before anything loads; nothing in a checkpoint can run code. Details: docs/resume.md, docs/security.md."""


def complete_path(incomplete: str):
    from rlcli.completion_keys import complete_ckpt_path_described

    return complete_ckpt_path_described(incomplete)


def complete_override(incomplete: str):
    from rlcli.completion_keys import complete_override as _complete

    return _complete(incomplete)


def register(app: typer.Typer) -> None:
    @app.command("resume", epilog=EPILOG, rich_help_panel="Run")
    def resume(
        path: Annotated[str, typer.Argument(
            help="A run directory (its latest complete step_N is used) or one step_N directory.",
            show_default=False, autocompletion=complete_path)],
        overrides: Annotated[Optional[list[str]], typer.Argument(
            help="key=value changes allowed on resume, e.g. trainer.total_steps=200 trainer.nprocs=1.",
            show_default=False, autocompletion=complete_override)] = None,
        dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="Print what would be restored and from where; load nothing, change nothing.",
            rich_help_panel="Output")] = False,
        allow_partial: Annotated[bool, typer.Option(
            "--allow-partial", help="Resume even if optimizer state the manifest promises is missing: those "
            "parameters restart from the initial AdamW state (said in red).", rich_help_panel="Checkpoint")] = False,
        no_verify: Annotated[bool, typer.Option(
            "--no-verify", help="Skip checking every file's content hash against the manifest (for huge "
            "checkpoints; sizes, structure and cross-checks are still checked). Said in red.",
            rich_help_panel="Checkpoint")] = False,
        json_out: Annotated[bool, typer.Option(
            "--json", help="--dry-run: the plan as JSON on stdout. Otherwise the final summary as JSON on stdout "
            "(plan and progress go to stderr).", rich_help_panel="Output")] = False,
    ) -> None:
        """Continue a run exactly where its checkpoint left off (model, optimizer, LR schedule, RNG, data)."""
        from pathlib import Path

        from rlcli.output import call_engine, json_errors, print_json_or_error, stderr_console, stdout_console
        from rlcli.render.resume import resume_table
        from rlcli.run_render import run_and_render

        from engine.checkpoint.plan import plan_resume
        json_errors(json_out)

        console, err_console = stdout_console(), stderr_console()

        plan = call_engine(plan_resume, Path(path), list(overrides or []), allow_partial=allow_partial,
                           verify=not no_verify)
        report = None
        if dry_run:  # the same preflight the run does (extras, model, reward, run directory); creates nothing
            from engine.trainer.preflight import preflight

            report = call_engine(preflight, plan.config, run_dir=Path(plan.run_dir), resume=plan)
            report.close()
        if json_out and dry_run:  # refused: the plan with the refusal under "error" (then the panel, exit 2)
            print_json_or_error(plan.to_json() | {"preflight": report.to_json()}, plan.raise_if_refused,
                                report.raise_if_failed)
        else:
            (err_console if json_out else console).print(resume_table(plan))
            if report is not None:
                from rlcli.render.preflight import preflight_table

                console.print(preflight_table(report))
        call_engine(plan.raise_if_refused)
        if dry_run:
            call_engine(report.raise_if_failed)
            return
        run_and_render(plan.config, overrides=plan.overrides, changed=plan.changed, json_out=json_out, resume=plan)
