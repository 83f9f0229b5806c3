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


def versions_ahead(cfg: RunConfig) -> int:
    """How many policy versions rollouts may run ahead of the update (trainer.mode): sync 0,
    one_step_off 1, async trainer.max_staleness; streamed 0 (on-policy, on a rollout worker).
    0 with mode sync = the synchronous trainer, exactly."""
    t = cfg.trainer
    return {"sync": 0, "one_step_off": 1, "streamed": 0}.get(t.mode, t.max_staleness)


def uses_rollout_worker(cfg: RunConfig) -> bool:
    """Whether the rollout runs on a rollout worker apart from the ranks (every mode but sync's;
    async with max_staleness=0 is the sync trainer and has none)."""
    return versions_ahead(cfg) > 0 or cfg.trainer.mode == "streamed"


def stream_chunk_groups(cfg: RunConfig) -> int:
    """trainer.mode=streamed: prompt groups per chunk (trainer.stream_chunk_groups; 0 = a quarter of
    the batch), at least enough for one row on every rank."""
    n, ranks = cfg.algorithm.rollout_n, cfg.trainer.nprocs
    want = cfg.trainer.stream_chunk_groups or -(-cfg.data.train_batch_size // 4)
    return max(want, -(-ranks // n))


def rollout_is_level(cfg: RunConfig) -> str:
    """algorithm.rollout_is with ``auto`` resolved: token when rollouts run ahead, else off."""
    level = cfg.algorithm.rollout_is
    if level == "auto":
        return "token" if versions_ahead(cfg) and not behavior_ratio(cfg) else "off"
    return level


def behavior_ratio(cfg: RunConfig) -> bool:
    """PPO's ratio is against the sampler's log-probs (algorithm.off_policy_ratio=behavior, with
    samples that may be stale); else against the trainer's at the update."""
    return cfg.algorithm.off_policy_ratio == "behavior" and versions_ahead(cfg) > 0


@dataclass(frozen=True)
class ResolvedRun:
    """A validated config and what follows from it, as every rank receives it."""

    config: RunConfig
    model_parallel: int       # ranks per model replica
    data_parallel: int        # model replicas (each gets its share of every batch)
    mini_batch_prompts: int   # prompts per optimizer step
    updates_per_step: int     # optimizer steps per RL step (sizes the LR schedule)
    versions_ahead: int = 0   # trainer.mode: policy versions rollouts may run ahead (0 = sync)
    rollout_is: str = "off"   # algorithm.rollout_is resolved (off, token, sequence)
    behavior_ratio: bool = False  # PPO's ratio against the sampler's log-probs (algorithm.off_policy_ratio)


def resolve_run(cfg: RunConfig) -> ResolvedRun:
    """``cfg`` (already validated: engine/config/validate.py) resolved for the ranks."""
    mp = model_parallel_size(cfg)
    return ResolvedRun(config=cfg, model_parallel=mp, data_parallel=max(1, cfg.trainer.nprocs // mp),
                       mini_batch_prompts=mini_batch_prompts(cfg), updates_per_step=updates_per_step(cfg),
                       versions_ahead=versions_ahead(cfg), rollout_is=rollout_is_level(cfg),
                       behavior_ratio=behavior_ratio(cfg))
