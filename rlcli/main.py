"""The `rl` command line. Thin: parse, call engine/, render the result.

Nothing heavy is imported here (no torch, ray, vllm, megatron): `rl --help` and TAB
completion import only this module, typer and the command modules' signatures.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

app = typer.Typer(
    name="rl",
    help="Launch and inspect RL post-training runs of language models (GRPO/PPO on FSDP2 or Megatron).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each module in rlcli/commands defines register(app). Order is the order in --help.
COMMAND_MODULES = ("train", "resume", "config", "eval", "inspect_ckpt", "export", "plot", "mem_report", "env")

for _name in COMMAND_MODULES:  # a missing or broken command module fails loudly, never silently
    importlib.import_module(f"rlcli.commands.{_name}").register(app)


def main() -> None:
    from engine.threads import apply_process_defaults

    apply_process_defaults()  # this process's OpenMP waits, before anything loads torch (engine/threads.py)
    if os.environ.get("_RL_COMPLETE"):  # a TAB: skip Typer's pydantic coercion and rich help rendering
        from rlcli.completion_keys import speed_up_completion

        speed_up_completion()
    from rlcli.fast_exit import leave

    try:
        app()
    except SystemExit as e:
        usage_error_json(e.code, sys.argv[1:])
        leave(e.code)
    leave(0)


def usage_error_json(code, argv: list[str]) -> None:
    """`--json` given but the command line itself was refused (an unknown option, a missing
    argument): click printed its usage error on stderr before any command ran, and stdout stayed
    empty. Print the error as the one JSON document stdout holds under --json."""
    if code != 2 or "--json" not in argv:  # checked first: a TAB's exit imports nothing more
        return
    from rlcli.output import json_errors, json_state, print_json_error

    if not json_state()["on"]:  # the command never started (it sets the state first thing)
        json_errors(True)
        print_json_error("the command line is not valid: see the usage message on stderr (`rl <command> --help`).",
                         "usage error", 2)


if __name__ == "__main__":
    main()
