"""`rl inspect-ckpt PATH`: see inside any checkpoint without loading its tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

EPILOG = """\
[bold]Examples[/]

  [dim]# a run: every step, complete or not, sizes, which is latest[/]
  rl inspect-ckpt ckpt/

  [dim]# one checkpoint: summary, groups, optimizer coverage, config check[/]
  rl inspect-ckpt ckpt/step_40

  [dim]# per-tensor rows for names matching a glob[/]
  rl inspect-ckpt ckpt/step_40 --keys 'model.layers.0.*'

  [dim]# what changed: tensor keys, shapes, dtypes, config values[/]
  rl inspect-ckpt ckpt/step_40 --diff ckpt/step_80

  [dim]# is every byte what the save wrote? (content hashes, manifest cross-checks)[/]
  rl inspect-ckpt ckpt/step_40 --verify

  [dim]# the same facts as JSON, for scripts[/]
  rl inspect-ckpt ckpt/step_40 --json | jq .groups

  [dim]# Hugging Face safetensors (sharded or not), verl FSDP, Megatron, DCP, torch.save[/]
  rl inspect-ckpt /models/Qwen2.5-0.5B
  rl inspect-ckpt verl_ckpt/global_step_100

Only metadata (and small non-tensor values) is read; pickled files go through a restricted,
bounded reader that never runs code. Threat model and checks: docs/security.md.
"""


def complete_path(incomplete: str):
    from rlcli.completion_keys import complete_inspect_path

    return complete_inspect_path(incomplete)


def register(app: typer.Typer) -> None:
    @app.command(
        "inspect-ckpt",
        rich_help_panel="Inspect",
        help="See inside any checkpoint without loading its tensors: rl, DCP, Megatron, "
             "safetensors, verl FSDP, torch.save.",
        epilog=EPILOG,
    )
    def inspect_ckpt(
        path: Path = typer.Argument(..., help="checkpoint dir or file, or a run root (ckpt/)",
                                    metavar="PATH", show_default=False, autocompletion=complete_path),
        keys: Optional[str] = typer.Option(
            None, "--keys", metavar="GLOB",
            help="list tensors whose name matches GLOB (e.g. 'model.layers.0.*'; '*' for all)"),
        diff: Optional[Path] = typer.Option(
            None, "--diff", metavar="OTHER",
            help="compare with checkpoint OTHER: tensors added/removed, shapes, dtypes, config"),
        json_out: bool = typer.Option(False, "--json", help="print the report as JSON on stdout"),
        verify: bool = typer.Option(
            False, "--verify",
            help="rl checkpoints: check every file against the content hashes in its manifest, and the "
                 "manifest against the shards (reads every byte once; exit 2 on any mismatch)"),
    ) -> None:
        from engine.errors import UserError
        from engine.inspect import diff_paths, inspect_checkpoint, inspect_path
        from engine.inspect.report import RunReport
        from rlcli.output import call_engine, json_errors, print_json, stdout_console
        from rlcli.render import inspect as render
        json_errors(json_out)

        console = stdout_console()

        if diff is not None:
            if verify:
                call_engine(_raise, UserError("--verify and --diff do not combine: verify each checkpoint "
                                              "with its own `rl inspect-ckpt PATH --verify`.", title="usage"))
            d = call_engine(diff_paths, path, diff)
            if keys is not None:
                d = call_engine(_filter_diff, d, keys)
            if json_out:
                print_json(d.to_json())
            else:
                render.render_diff(d, console)
            return

        rep = call_engine(inspect_checkpoint if keys is not None else inspect_path, path, verify=verify)
        if keys is not None and not rep.select(keys):
            sample = ", ".join(t.name for t in rep.tensors[:4]) or "none (no tensors)"
            call_engine(_raise, UserError(
                f"no tensor name matches {keys!r} in {path}. Names look like: {sample}. "
                "Quote the glob so the shell leaves it alone: --keys 'model.*'.",
                title="no match"))
        if json_out:
            print_json(rep.to_json() if isinstance(rep, RunReport) else rep.to_json(keys=keys))
        elif isinstance(rep, RunReport):
            render.render_run(rep, console)
        else:
            render.render_checkpoint(rep, console, keys=keys)


def _raise(e: Exception) -> None:
    raise e


def _filter_diff(d, pattern: str):
    """Keep only the diff rows whose name matches ``pattern``."""
    from fnmatch import fnmatchcase

    d.added = [t for t in d.added if fnmatchcase(t.name, pattern)]
    d.removed = [t for t in d.removed if fnmatchcase(t.name, pattern)]
    d.shape_changed = [c for c in d.shape_changed if fnmatchcase(c.name, pattern)]
    d.dtype_changed = [c for c in d.dtype_changed if fnmatchcase(c.name, pattern)]
    d.objects_added = [n for n in d.objects_added if fnmatchcase(n, pattern)]
    d.objects_removed = [n for n in d.objects_removed if fnmatchcase(n, pattern)]
    return d
