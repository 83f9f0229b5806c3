"""`rl config show`: print the config `rl train` would compose, without running anything."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

EPILOG = """[bold]Examples[/]

  rl config show                                  [dim]# every key, as YAML (the defaults)[/]
  rl config show task=add optim.lr=1e-3 --diff-from-defaults   [dim]# only what differs, defaults as comments[/]
  rl config show --config runs/a/config.yaml trainer.total_steps=100
  rl config show --diff-from-defaults task=add > exp.yaml && rl train --config exp.yaml
  rl config show --json | jq .config.optim

The output is itself a config file for [bold]rl train --config[/]. Every key: docs/config-reference.md."""

config_app = typer.Typer(name="config", help="Show the run configuration that `rl train` would compose.",
                         no_args_is_help=True, rich_markup_mode="rich")


def complete_override(incomplete: str):
    from rlcli.completion_keys import complete_override as _complete

    return _complete(incomplete)


def complete_engine(incomplete: str):
    from rlcli.completion_keys import engine_options

    return [e for e in engine_options() if e.startswith(incomplete)]


def complete_config_file(incomplete: str):
    from rlcli.completion_keys import complete_config_file as _complete

    return _complete(incomplete)


@config_app.command("show", epilog=EPILOG)
def show(
    overrides: Annotated[Optional[list[str]], typer.Argument(
        help="Overrides, as for rl train: key=value (trainer.total_steps=50) or group=option (task=add).",
        show_default=False, autocompletion=complete_override)] = None,
    config_file: Annotated[Optional[str], typer.Option(
        "--config", "-c", help="Start from this YAML file of config keys (a run's config.yaml reproduces that "
        "run); the overrides win over it.", autocompletion=complete_config_file, show_default=False)] = None,
    engine: Annotated[Optional[str], typer.Option(
        "--engine", "-e", help="Training backend: fsdp or megatron (same as engine=<name>).",
        autocompletion=complete_engine)] = None,
    diff: Annotated[bool, typer.Option(
        "--diff-from-defaults", help="Show only the keys that differ from the defaults, each with its default.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the config as JSON on stdout.")] = False,
) -> None:
    """Print the composed config (defaults <- --config FILE <- overrides) as YAML; nothing runs."""
    from rlcli.output import call_engine, json_errors, print_json

    from engine.config.show import show_config
    json_errors(json_out)

    view = call_engine(show_config, list(overrides or []), engine=engine, config_file=config_file,
                       diff_from_defaults=diff)
    if json_out:
        print_json(view.to_json())
        return
    import sys

    from rlcli.output import stdout_console
    from rlcli.render.config import config_yaml

    text = config_yaml(view)
    console = stdout_console()
    if console.is_terminal:
        from rich.syntax import Syntax

        console.print(Syntax(text, "yaml", word_wrap=True, background_color="default"))
    else:  # a pipe or a file: the YAML exactly, never wrapped or cropped to a width
        sys.stdout.write(text)
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config", rich_help_panel="Run")
