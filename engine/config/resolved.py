"""What a run's config implies, worked out once on the driver: the parallel layout, the
mini-batch and the optimizer steps per RL step. The driver ships the ``ResolvedRun`` to every
rank, which uses it as it is (no rank validates or derives these again)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.schema import RunConfig


def model_parallel_size(cfg: RunConfig) -> int:
    """Ranks that hold one copy of the model between them (megatron: TP x PP x CP; FSDP2: 1,
    every rank is data parallel)."""
    e = cfg.engine
    if e.name != "megatron":
        return 1
    return e.tensor_model_parallel_size * e.pipeline_model_parallel_size * e.context_parallel_size


def mini_batch_prompts(cfg: RunConfig) -> int:
    """Prompts per optimizer step (``algorithm.ppo_mini_batch_size``, 0 = the whole batch)."""
    return cfg.algorithm.ppo_mini_batch_size or cfg.data.train_batch_size


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer steps per RL step: ``ppo_epochs`` passes over the batch's mini-batches."""
    return cfg.algorithm.ppo_epochs * (cfg.data.train_batch_size // mini_batch_prompts(cfg))


@dataclass(frozen=True)
class ResolvedRun:
    """A validated config and what follows from it, as every rank receives it."""

    config: RunConfig
    model_parallel: int       # ranks per model replica
    data_parallel: int        # model replicas (each gets its share of every batch)
    mini_batch_prompts: int   # prompts per optimizer step
    updates_per_step: int     # optimizer steps per RL step (sizes the LR schedule)


def resolve_run(cfg: RunConfig) -> ResolvedRun:
    """``cfg`` (already validated: engine/config/validate.py) resolved for the ranks."""
    mp = model_parallel_size(cfg)
    return ResolvedRun(config=cfg, model_parallel=mp, data_parallel=max(1, cfg.trainer.nprocs // mp),
                       mini_batch_prompts=mini_batch_prompts(cfg), updates_per_step=updates_per_step(cfg))
