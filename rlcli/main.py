"""The `rl` command line. Thin: parse, call engine/, render the result.

Nothing heavy is imported here (no torch, ray, vllm, megatron): `rl --help` and TAB
completion import only this module, typer and the command modules' signatures.
"""

from __future__ import annotations

import importlib
import os

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
COMMAND_MODULES = ("train", "resume", "inspect_ckpt", "export", "plot", "mem_report", "env")

for _name in COMMAND_MODULES:  # a missing or broken command module fails loudly, never silently
    importlib.import_module(f"rlcli.commands.{_name}").register(app)


def main() -> None:
    if os.environ.get("_RL_COMPLETE"):  # a TAB: skip Typer's pydantic coercion and rich help rendering
        from rlcli.completion_keys import speed_up_completion

        speed_up_completion()
    from rlcli.fast_exit import leave

    try:
        app()
    except SystemExit as e:
        leave(e.code)
    leave(0)


if __name__ == "__main__":
    main()
