"""`rl train`: compose the config, launch the run, render what it reports."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

EPILOG = """[bold]Examples[/]

  rl train                                        [dim]# embedded default: tiny model, echo task, fsdp, CPU[/]
  rl train --engine fsdp trainer.total_steps=50 algorithm.rollout_n=8 data.train_batch_size=16
  rl train --engine fsdp trainer.nprocs=2         [dim]# two data-parallel ranks (gloo on CPU, nccl on GPU)[/]
  rl train --engine megatron trainer.nprocs=2 engine.tensor_model_parallel_size=2
  rl train task=add optim.lr=5e-3
  rl train model.path=/models/Qwen2.5-0.5B task=dataset task.path=prompts.jsonl task.reward_fn=mypkg.rewards:exact_match
  rl train task=dataset task.path=trl.jsonl task.reward_fn=./rewards.py:format_reward_func   [dim]# TRL's fn(completions, **kwargs)[/]
  rl train task=dataset task.path=verl.parquet task.reward_fn=./scorer.py:compute_score   [dim]# verl's compute_score[/]
  rl train --dry-run engine.pad_to_length=true    [dim]# validate and print the plan, run nothing[/]
  rl train --config runs/a/config.yaml            [dim]# a run's own config.yaml: the same run again[/]
  rl train --config exp.yaml optim.lr=1e-3 checkpoint.dir=runs/b   [dim]# a file, then overrides (they win)[/]

Every key: docs/config-reference.md; the composed config: [bold]rl config show[/] (takes the same arguments).
Continue a run: [bold]rl resume ckpt/[/]."""


def complete_engine(incomplete: str):
    from rlcli.completion_keys import engine_options

    return [e for e in engine_options() if e.startswith(incomplete)]


def complete_override(incomplete: str):
    from rlcli.completion_keys import complete_override as _complete

    return _complete(incomplete)


def complete_config_file(incomplete: str):
    from rlcli.completion_keys import complete_config_file as _complete

    return _complete(incomplete)


def register(app: typer.Typer) -> None:
    @app.command("train", epilog=EPILOG, rich_help_panel="Run")
    def train(
        overrides: Annotated[Optional[list[str]], typer.Argument(
            help="Hydra-style overrides: key=value (e.g. trainer.total_steps=50) or group=option (task=add).",
            show_default=False, autocompletion=complete_override)] = None,
        engine: Annotated[Optional[str], typer.Option(
            "--engine", "-e", help="Training backend: fsdp or megatron (same as engine=<name>).",
            autocompletion=complete_engine, rich_help_panel="Engine")] = None,
        config_file: Annotated[Optional[str], typer.Option(
            "--config", "-c", help="Start from this YAML file of config keys (a run's own config.yaml reproduces "
            "the run; a partial file sets only its keys); the overrides win over it.",
            autocompletion=complete_config_file, show_default=False, rich_help_panel="Config")] = None,
        dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="Validate the config, run the preflight checks (extras, model, reward function, "
            "run directory) and print the resolved config; create nothing.",
            rich_help_panel="Output")] = False,
        json_out: Annotated[bool, typer.Option(
            "--json", help="Print the final summary as JSON on stdout (progress goes to stderr).",
            rich_help_panel="Output")] = False,
    ) -> None:
        """Launch an RL run: rollout, reward, advantages, policy update, checkpoints."""
        from rlcli.output import call_engine, json_errors
        from rlcli.run_render import render_config, run_and_render

        from engine.config.load import load_run_config
        json_errors(json_out)

        from engine.evaluate.config import refuse_eval_keys

        call_engine(refuse_eval_keys, list(overrides or []))
        loaded = call_engine(load_run_config, list(overrides or []), engine=engine, config_file=config_file)
        if dry_run:
            from engine.trainer.preflight import preflight

            report = call_engine(preflight, loaded.config, env_refs=loaded.env_refs)
            report.close()
            render_config(loaded, json_out, report)
            call_engine(report.raise_if_failed)
            return
        run_and_render(loaded.config, overrides=loaded.overrides, changed=loaded.changed, json_out=json_out,
                       env_refs=loaded.env_refs)
