"""`rl export PATH`: an rl checkpoint to a Hugging Face model directory."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

EPILOG = """[bold]Examples[/]

  rl export ckpt/                                  [dim]# latest complete step -> ckpt/step_N/hf/[/]
  rl export ckpt/step_20 --out policy/ --dtype bfloat16
  rl export ckpt/ --out policy/ --overwrite        [dim]# replace policy/ (only once the new one is complete)[/]
  rl export ckpt/ --adapter --out lora/            [dim]# LoRA run: a PEFT adapter dir instead of merged weights[/]
  rl export ckpt/ --json                           [dim]# files, sizes, dtype, parameters as JSON[/]

Reads only the model entries of the checkpoint (never the optimizer state), one output shard
at a time. FSDP checkpoints of any world size and Megatron checkpoints (any TP) export alike.
The result loads with AutoModelForCausalLM/AutoTokenizer.from_pretrained and in vLLM. Details: docs/export.md."""


def complete_path(incomplete: str):
    from rlcli.completion_keys import complete_ckpt_path_described

    return complete_ckpt_path_described(incomplete)


def register(app: typer.Typer) -> None:
    @app.command("export", epilog=EPILOG, rich_help_panel="Inspect")
    def export(
        path: Annotated[str, typer.Argument(
            help="A run directory (its latest complete step_N is used) or one step_N directory.",
            show_default=False, autocompletion=complete_path)],
        out: Annotated[Optional[str], typer.Option(
            "--out", "-o", metavar="DIR", help="Output directory (default: <step_N>/hf, or <step_N>/hf-adapter "
            "with --adapter).", show_default=False)] = None,
        dtype: Annotated[Optional[str], typer.Option(
            "--dtype", help="Weights dtype: float32, bfloat16 or float16 (default: the run's model.dtype).",
            show_default=False, autocompletion=lambda: ["float32", "bfloat16", "float16"])] = None,
        overwrite: Annotated[bool, typer.Option(
            "--overwrite", help="Replace a non-empty --out (the old directory goes only after the new one is "
            "complete).")] = False,
        adapter: Annotated[bool, typer.Option(
            "--adapter", help="LoRA runs: write a PEFT adapter directory instead of merging into the base "
            "weights.")] = False,
        max_shard_size: Annotated[str, typer.Option(
            "--max-shard-size", metavar="SIZE", help="Split weights into safetensors shards (with an index) "
            "above this size, e.g. 5GB, 500MB.")] = "5GB",
        json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    ) -> None:
        """Write a Hugging Face model directory (config, generation config, safetensors, tokenizer) from a
        checkpoint, atomically."""
        from rlcli.output import call_engine, json_errors, print_json, stdout_console

        from engine.export import export_checkpoint
        json_errors(json_out)

        console = stdout_console()

        result = call_engine(export_checkpoint, path, out=out, dtype=dtype, overwrite=overwrite, adapter=adapter,
                             max_shard_size=max_shard_size)
        if json_out:
            print_json(result.to_json())
            return
        from rlcli.render.export import export_table

        console.print(export_table(result))
