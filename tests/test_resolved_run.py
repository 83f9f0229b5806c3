"""What a config implies is worked out once, on the driver (engine/config/resolved.py), and the
ranks take it as it is: the optimizer steps per RL step that size every rank's LR schedule, and
the parallel layout, follow from the config by their definitions, and no rank validates again."""

from __future__ import annotations

import ast
from pathlib import Path

from engine.config.load import load_run_config
from engine.config.resolved import resolve_run

ROOT = Path(__file__).resolve().parents[1]


def test_updates_per_step_are_epochs_times_mini_batches():
    """8 prompts a step in mini-batches of 2 prompts, 3 epochs: 3 x 4 = 12 optimizer steps; no
    mini-batch size: one mini-batch, so ppo_epochs steps."""
    run = resolve_run(load_run_config(["data.train_batch_size=8", "algorithm.ppo_mini_batch_size=2",
                                       "algorithm.ppo_epochs=3"]).config)
    assert (run.mini_batch_prompts, run.updates_per_step) == (2, 12)
    run = resolve_run(load_run_config(["data.train_batch_size=8", "algorithm.ppo_epochs=2"]).config)
    assert (run.mini_batch_prompts, run.updates_per_step) == (8, 2)


def test_the_parallel_layout_is_model_parallel_times_data_parallel():
    run = resolve_run(load_run_config(["trainer.nprocs=4", "engine.tensor_model_parallel_size=2",
                                       "data.train_batch_size=4"], engine="megatron").config)
    assert (run.model_parallel, run.data_parallel) == (2, 2)
    run = resolve_run(load_run_config(["trainer.nprocs=4", "data.train_batch_size=4"]).config)
    assert (run.model_parallel, run.data_parallel) == (1, 4)


def test_ranks_receive_the_resolved_run_and_do_not_validate_again():
    """The rank's code imports no validation: a rank that re-validated could refuse, or resolve
    differently, what the driver accepted (and spent ~0.1 s a rank doing it)."""
    for path in ("engine/trainer/worker.py",):
        tree = ast.parse((ROOT / path).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "engine.config.validate" not in imported and "engine.config.load" not in imported, path
    src = (ROOT / "engine/trainer/worker.py").read_text()
    assert "def __init__(self, run: ResolvedRun," in src
