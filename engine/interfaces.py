"""The contracts between the rank worker and what it drives: a training engine (FSDP2, Megatron),
a rollout sampler (torch, vLLM) and a policy loss. The worker (engine/trainer/worker.py) uses
exactly these members and nothing else (tests/test_interfaces.py checks both sides).

The abstract bases that implement them with shared defaults are
engine.backends.base.TrainEngine and engine.rollout.base.Sampler.

World-size rules, stated once:
- gradients: every backend's data-parallel reduction *averages* over ``dp_size`` ranks, so a
  loss returns its contribution to the global mini-batch aggregate multiplied by ``dp_size``
  (engine.algorithms.policy_loss.PolicyLoss); the average then gives the global gradient.
- metrics: ``StepStats.metrics`` are this data-parallel group's *partial sums* of a global
  aggregate; the driver adds them over data-parallel groups, one rank per group
  (engine.trainer.rank_results.combine_update). ``StepStats.replicated`` holds values every rank
  computes identically (grad norm, learning rate); the driver takes them from rank 0.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class LossFn(Protocol):
    """Per micro-batch: (log_probs [b, t], entropy [b, t] | None, micro_batch, n_tokens_global,
    n_seqs_global) -> (loss already scaled for accumulation and the DP mean, {metric: float})."""

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss differentiates through the entropy (the engine keeps its graph)."""

    def __call__(self, log_probs, entropy, micro_batch, n_tokens: float, n_seqs: float) -> tuple[Any, dict]: ...


@runtime_checkable
class TrainingEngine(Protocol):
    dp_rank: int                 # this rank's data-parallel index (which shard of the data it gets)
    dp_size: int                 # number of data-parallel groups
    model: Any                   # the trained policy (backend-wrapped)
    optimizer: Any
    bucket_policy: Any           # engine.batching.buckets.BucketPolicy
    tracker: Any                 # engine.memory.tracker.MemoryTracker, set by the worker
    critic: Any                  # engine.backends.critic value model (algorithm=ppo), set by the worker; else None
    lora_reference: dict | None  # LoRA: the base model it adapts ({"base_path", "base_sha256", ...}); else None

    def build(self) -> None: ...
    def compute_log_probs(self, batch, ref: bool = False, with_entropy: bool = False): ...
    def train_step(self, batch, loss_fn: LossFn): ...
    # trainer.mode=streamed: one optimizer step whose batch arrives in chunks; the loss is taken as
    # a sum and divided by the whole batch's counts at the end (engine/backends/base.py)
    def stream_begin(self) -> None: ...
    def stream_chunk(self, chunk, loss_fn: LossFn) -> None: ...
    def stream_finish(self, n_tokens: float, n_seqs: float, loss_fn: LossFn): ...
    def generation_model(self) -> AbstractContextManager: ...
    def export_hf_state_dict(self, keep: bool = True) -> dict: ...
    def offload(self): ...
    def onload(self): ...
    def checkpoint_state(self) -> dict: ...
    def load_checkpoint_state(self, state: dict) -> None: ...
    def optimizer_coverage(self) -> dict[str, bool]: ...
    @property
    def lr_scheduler(self): ...
    def param_count(self) -> int: ...
    def param_shapes(self) -> dict[str, dict]: ...
    def routing_report(self, batch) -> dict: ...  # MoE routing metrics' partial sums (router replay on)


@runtime_checkable
class RolloutSampler(Protocol):
    reads_live_model: bool       # True: generate() samples from the engine's live model; False: own copy
    last_kv_cache_bytes: int     # KV cache of the last generate() (memory records)
    last_sync: dict              # timings and bytes of the last sync_weights() ({} when it never syncs)

    def generate(self, model, prompts: list[list[int]], n: int, generator, greedy: bool = False): ...
    # (first row, SequenceBatch) pieces; with stream=True each prompt group as it ends (trainer.stream_groups)
    def generate_pieces(self, model, prompts: list[list[int]], n: int, generator, greedy: bool = False,
                        stream: bool = False): ...
    def sync_weights(self, state_dict: dict) -> float: ...
    def verify_sync(self, engine, batch): ...
    def memory(self) -> dict | None: ...
    def sleep(self) -> None: ...
    def shutdown(self) -> None: ...
