"""Which config keys `rl resume` may change, and why (docs/resume.md, "What may change").

The rule is an allow-list: a key may differ from the checkpoint's config only if it is
listed in ``ALLOWED`` (with the reason it is safe). Everything else is refused, with the
reason from ``REFUSED`` (longest matching prefix) or a default one. A key added to the
schema later is therefore refused until someone decides it is safe to change mid-run.

Allowed keys change *how* the run executes (length, ranks, logging, checkpoint cadence,
memory layout); refused keys change *what* is being trained, or would be silently ignored
because the checkpoint restores them (optimizer hyper-parameters, LR schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

_RESHARD = "DCP reshards model and optimizer state to the new layout (per-rank RNG streams change, so the " \
           "continuation is not bit-exact)"
_MEMORY = "changes where tensors rest or how work is split, not what is trained"
_PADDING = "changes padding shapes only; a learned policy's saved boundaries are checked on load"

ALLOWED: dict[str, str] = {
    "trainer.total_steps": "extends or shortens the run; with a decaying LR schedule the decay horizon follows "
                           "the new length",
    "trainer.nprocs": _RESHARD,
    "trainer.device": "DCP loads onto either device (numerics differ between devices)",
    "trainer.val_freq": "validation cadence only",
    "trainer.log_freq": "printing only",
    "trainer.loggers": "where metrics are logged, not what is trained",
    "trainer.project": "where metrics are logged, not what is trained",
    "trainer.sample_log_freq": "sample logging cadence only",
    "trainer.sample_log_n": "sample logging only",
    "trainer.ray_address": "where the ranks run",
    "trainer.nnodes": "where the ranks run",
    "trainer.ranks_per_node": "where the ranks run",
    "trainer.placement": "where the ranks run",
    "trainer.ray_timeout_s": "a timeout",
    "trainer.threads_per_rank": "CPU threads per rank (float sums may round differently)",
    "trainer.adapt_threads": "CPU threads per rank (float sums may round differently)",
    "trainer.keep_host_heap": "how ranks' freed host memory is kept (the same numbers)",
    "trainer.omp_wait": "how ranks' idle threads wait (the same numbers)",
    "checkpoint.save_freq": "checkpoint cadence",
    "checkpoint.keep_last": "checkpoint retention",
    "checkpoint.save_final": "checkpoint cadence",
    "checkpoint.overwrite": "has no effect on resume",
    "engine.param_offload": _MEMORY,
    "engine.optimizer_offload": _MEMORY,
    "engine.micro_batch_size": _MEMORY + " (gradient sums may round differently)",
    "engine.max_tokens_per_micro_batch": _MEMORY + " (gradient sums may round differently)",
    "engine.gradient_checkpointing": _MEMORY,
    "engine.compile": "compiles the same forward",
    "engine.fused_kernels": "the same formulas as fused kernels (float sums may round differently)",
    "engine.reshard_after_forward": _MEMORY,
    "engine.fsdp_unit": _MEMORY + " (the same parameters under the same names and shapes)",
    "engine.cpu_matmul": "the same products by another GEMM library (float sums may round differently)",
    "engine.skip_zero_advantage_rows": "skips only rows that get no gradient (float sums may round differently)",
    "engine.pad_to_length": _PADDING,
    "engine.pad_to_length_bucket": _PADDING,
    "engine.pad_to_length_policy": _PADDING,
    "engine.pad_to_length_max_shapes": _PADDING,
    "engine.pad_to_length_refresh_steps": _PADDING,
    "engine.tensor_model_parallel_size": "megatron checkpoints hold full tensors under HF names; " + _RESHARD,
    "engine.pipeline_model_parallel_size": "megatron checkpoints hold full tensors under HF names; " + _RESHARD,
    "engine.context_parallel_size": "megatron checkpoints hold full tensors under HF names; " + _RESHARD,
    "engine.sequence_parallel": "megatron: activation layout only",
    "engine.use_distributed_optimizer": "megatron checkpoints hold full optimizer tensors; " + _RESHARD,
    "engine.expert_model_parallel_size": "megatron checkpoints hold every expert under its HF name; " + _RESHARD,
    "task.reward_workers": "where reward functions run, not what they compute",
    "task.reward_timeout_s": "a timeout",
    "task.reward_on_error": "what happens when a reward call fails (scores are unchanged otherwise)",
    "task.reward_model.placement": "where the reward model runs, not what it computes",
    "task.reward_model.num_gpus": "where the reward model runs, not what it computes",
    "task.reward_model.batch_size": "how many responses the reward model reads at once (float sums may round "
                                    "differently)",
    "task.reward_url": "where the remote scorer is served (a moved server)",
    "task.reward_url_timeout_s": "a timeout",
    "task.reward_url_retries": "how often a failed request is retried",
    "task.reward_url_batch_size": "how many samples one request carries",
    "task.allow_dataset_change": "lets `rl resume` continue on a changed dataset (checked separately)",
    "rollout.name": "changes how samples are generated, not their distribution",
    "rollout.micro_batch_size": _MEMORY,
    "rollout.decode_lanes": "CPU threads of the rollout (the sampling noise does not depend on it; float sums may round differently)",
    "rollout.gpu_memory_utilization": _MEMORY,
    "rollout.verify_sync": "a check only",
}

REFUSED: dict[str, str] = {
    "model.": "the checkpoint's weights have this model's names and shapes",
    "engine.name": "the optimizer state layout belongs to the engine that wrote it",
    "engine.fp8": "changes the precision every matmul trains in",
    "task.": "the saved data position indexes this task's prompt set",
    "data.": "the saved data position counts prompts in this order and batch size",
    "trainer.seed": "seeds the data order that the saved position indexes, and every rank's sampler",
    "trainer.mode": "the checkpoint holds the rollouts sampled ahead under this mode (or none, in sync mode), "
                    "which the next steps train on",
    "trainer.max_staleness": "the checkpoint holds the rollouts sampled ahead for this many versions, which the "
                             "next steps train on",
    "optim.": "the optimizer's hyper-parameters and LR schedule are restored from the checkpoint, so a new "
              "value would be silently ignored",
    "algorithm.": "changes the objective the optimizer state was accumulated for",
    "eval.": "read by `rl eval`, not by training; evaluate the checkpoint with `rl eval <checkpoint> eval...`",
    "rollout.temperature": "changes the sampling distribution the policy is trained on",
    "rollout.top_p": "changes the sampling distribution the policy is trained on",
    "rollout.max_new_tokens": "changes the sampling distribution the policy is trained on",
    "checkpoint.dir": "resume continues in the run directory it was given; to branch a run, copy its directory "
                      "and resume the copy",
}
DEFAULT_REFUSAL = "not known to be safe to change in the middle of a run"


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs between the checkpoint's config and the resumed one."""

    key: str
    then: object
    now: object
    allowed: bool
    reason: str

    def to_json(self) -> dict:
        return {"key": self.key, "then": self.then, "now": self.now, "allowed": self.allowed, "reason": self.reason}


def classify(key: str) -> tuple[bool, str]:
    """(allowed, why) for changing ``key`` on resume."""
    if key in ALLOWED:
        return True, ALLOWED[key]
    best = max((p for p in REFUSED if key == p or (p.endswith(".") and key.startswith(p))), key=len, default=None)
    return False, REFUSED[best] if best else DEFAULT_REFUSAL


def classify_changes(diff: dict[str, tuple]) -> list[ConfigChange]:
    """``diff``: key -> (then, now), as engine.config.load.diff_configs returns it."""
    out = []
    for key, (then, now) in sorted(diff.items()):
        allowed, why = classify(key)
        out.append(ConfigChange(key, then, now, allowed, why))
    return out
