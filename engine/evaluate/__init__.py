"""`rl eval PATH [overrides]`: greedy and sampled evaluation of an rl checkpoint, an `rl export`
output or any Hugging Face causal-LM directory on a task's held-out (or train) split, scored by
the task's own reward functions.

    from engine.evaluate import evaluate
    result = evaluate("ckpt/", ["eval.n=8", "eval.k=[1,8]"])   # -> EvalResult (result.to_json())

Modules, one concept each: ``model_source`` (what PATH is, and the run's config if known),
``config`` (that config plus the overrides eval reads; others refused), ``pass_at_k`` (the
unbiased estimator), ``records`` (eval.jsonl, atomically), ``result`` (what the CLI renders),
``run`` (the steps in order).
"""

from engine.evaluate.run import evaluate

__all__ = ["evaluate"]
