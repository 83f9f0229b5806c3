"""`rl eval PATH [overrides]`: greedy and sampled evaluation of a checkpoint, an `rl export`
output or any Hugging Face causal-LM directory on a task's prompts."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

EPILOG = """[bold]Examples[/]

  rl eval ckpt/                                   [dim]# latest complete step, greedy, on the run's held-out split[/]
  rl eval ckpt/step_20 eval.n=8 eval.k=[1,8]      [dim]# + 8 samples per prompt: mean accuracy, pass@1, pass@8[/]
  rl eval ckpt/step_20/hf                         [dim]# an `rl export` output (the run's task, if its checkpoint is there)[/]
  rl eval /models/Qwen2.5-0.5B task=dataset task.path=test.parquet task.reward_fn=rl:math_verify
  rl eval ckpt/ rollout=vllm eval.n=16 eval.temperature=0.6    [dim]# sample with vLLM[/]
  rl eval ckpt/ eval.split=train eval.max_prompts=200 --json   [dim]# the numbers as JSON on stdout[/]

Scores every response with the task's own reward functions (task.reward_fn, or the built-in task's),
per data source (verl rows' data_source) and overall; pass@k by the unbiased estimator
1 - C(n-c,k)/C(n,k). Every response goes to eval.jsonl (eval.output=...; written atomically).
A checkpoint is evaluated under the run's own config (its task, its held-out prompts); overrides
may change task.*, eval.*, the sampler (rollout=vllm, rollout.max_new_tokens) and the device.
Every key: docs/config-reference.md ("eval"). Details: docs/eval.md."""


def complete_path(incomplete: str):
    from rlcli.completion_keys import complete_ckpt_path_described

    return complete_ckpt_path_described(incomplete)


def complete_override(incomplete: str):
    from rlcli.completion_keys import complete_override as _complete

    return _complete(incomplete)


def register(app: typer.Typer) -> None:
    @app.command("eval", epilog=EPILOG, rich_help_panel="Run")
    def eval_(
        path: Annotated[str, typer.Argument(
            help="An rl checkpoint (run directory or step_N), an `rl export` output, or a Hugging Face causal-LM "
                 "directory.", show_default=False, autocompletion=complete_path)],
        overrides: Annotated[Optional[list[str]], typer.Argument(
            help="key=value overrides: eval.* (eval.n=8, eval.k=[1,8], eval.split=train), task.* or task=<name>, "
                 "rollout=vllm, rollout.max_new_tokens, trainer.device.",
            show_default=False, autocompletion=complete_override)] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    ) -> None:
        """Evaluate a model on a task's prompts: greedy accuracy and reward, sampled pass@k, per data source."""
        from rlcli.output import call_engine, json_errors, print_json, stderr_console, stdout_console

        from engine.evaluate import evaluate
        json_errors(json_out)

        err = stderr_console()
        with err.status("rl eval", spinner="dots") as status:
            result = call_engine(evaluate, path, list(overrides or []),
                                 on_phase=lambda text: status.update(f"rl eval: {text}"))
        if json_out:
            print_json(result.to_json())
            return
        from rlcli.render.eval import eval_view

        stdout_console().print(eval_view(result))
