"""The training-engine interface that every backend (FSDP2, Megatron) implements.

One engine lives in each rank's worker process, after torch.distributed is initialised.
The trainer only ever talks to this interface (engine/interfaces.py TrainingEngine), so rollout, GRPO, checkpoints, resume,
offload and memory reports work unchanged on every backend.

Life cycle, per RL step (see engine/trainer/worker.py):

    engine.onload()                          # params/optimizer back on device if offloaded
    with engine.generation_model() as m:     # full (unsharded) HF-style causal LM for sampling
        rollout = sampler.generate(m, ...)
    lp = engine.compute_log_probs(batch)               # no grad, policy
    rlp = engine.compute_log_probs(batch, ref=True)    # no grad, frozen reference
    metrics = engine.train_step(mini_batch, loss_fn)   # micro-batched fwd/bwd, clip, step
    engine.offload()                          # frees device memory between phases
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engine.batch import SequenceBatch
from engine.memory.offload import OffloadReport  # noqa: F401  (re-exported: backends return it)

# loss_fn(log_probs [b, t], entropy [b, t] | None, micro_batch, n_tokens_global, n_seqs_global)
#   -> (loss scalar already scaled for accumulation, metrics dict of floats)
LossFn = Callable[..., tuple[torch.Tensor, dict]]


@dataclass
class StepStats:
    """What one optimizer step reports back to the trainer (world-size rules: engine/interfaces.py)."""

    metrics: dict = field(default_factory=dict)      # partial sums of global aggregates (added over DP groups)
    replicated: dict = field(default_factory=dict)   # identical on every rank (grad_norm, lr)
    tokens: int = 0            # real (unpadded) tokens processed in forward+backward
    padded_tokens: int = 0     # tokens including bucket padding
    shapes: set = field(default_factory=set)


def global_counts(batch: SequenceBatch, group=None, size: int = 1) -> tuple[float, float]:
    """(response tokens, sequences) of one mini-batch summed over the data-parallel ``group``:
    the denominators a LossFn needs so that ranks and micro-batches give the global aggregate."""
    n = torch.tensor([batch.response_mask.sum().item(), float(len(batch))])
    if size > 1:
        import torch.distributed as dist

        dist.all_reduce(n, group=group)
    return float(n[0]), float(n[1])


class TrainEngine(ABC):
    """A sharded policy (plus optional frozen reference) with its optimizer and schedule.

    Constructed on every rank after torch.distributed is initialised; ``build()`` does the
    heavy work. ``updates_per_step`` (optimizer steps per RL step) sizes the LR schedule.
    """

    optimizer = None   # set by build() (megatron: a property over its optimizer wrapper)
    critic = None          # the PPO value model (engine/backends/critic.py), attached by the worker
    lora_reference = None  # LoRA adapters: the base model they belong to (engine/model/lora.py)

    def __init__(self, cfg, model_path: str, vocab_size: int, pad_token_id: int, eos_token_id: int,
                 device: torch.device, updates_per_step: int):
        import torch.distributed as dist

        self.cfg = cfg
        self.model_path = model_path          # "" = the tiny built-in model
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = torch.device(device)    # the device this rank computes on
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_rank, self.dp_size = self.rank, self.world_size  # megatron: its data-parallel group
        self.total_updates = cfg.trainer.total_steps * updates_per_step
        self.model = None                     # the trained policy (backend-wrapped)
        self.ref_model = None                 # frozen reference, when algorithm.kl_coef > 0
        self.bucket_policy = None             # engine.batching.buckets.BucketPolicy, set by build()
        self.tracker = None                   # engine.memory.tracker.MemoryTracker, set by the worker
        self._offloaded = False

    @abstractmethod
    def build(self) -> None:
        """Create model(s), wrap them for parallelism, create optimizer and LR scheduler."""

    # ---- forward / backward -------------------------------------------------------------
    @abstractmethod
    def compute_log_probs(self, batch: SequenceBatch, ref: bool = False,
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log p(input_ids[:, t] | <t) as [B, T] (0 at t=0 and on padding), no grad."""

    @abstractmethod
    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> StepStats:
        """Micro-batch ``batch`` (this rank's share of one mini-batch), accumulate grads,
        all-reduce, clip, optimizer step, LR-scheduler step."""

    # ---- rollout ------------------------------------------------------------------------
    @abstractmethod
    @contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        """A full-weight causal LM (HF forward signature, KV cache) for sampling."""

    @abstractmethod
    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights under Hugging Face names (for vLLM sync and export)."""

    def routing_report(self, batch: SequenceBatch) -> dict:
        """Partial sums of the MoE routing metrics (engine/moe/routing_metrics.py) on this rank's
        rows; an engine without routing replay (config refuses it there) reports none."""
        from engine.moe.routing_metrics import RoutingSums

        return RoutingSums().to_dict()

    # ---- memory -------------------------------------------------------------------------
    @abstractmethod
    def offload(self) -> OffloadReport:
        """Move params (releasing grads) and/or optimizer state to host, as configured;
        clear Transformer-Engine FP8 weight workspaces on every param offload."""

    @abstractmethod
    def onload(self) -> OffloadReport:
        """Bring back whatever offload() moved."""

    # ---- checkpoints --------------------------------------------------------------------
    @abstractmethod
    def checkpoint_state(self) -> dict:
        """DCP-saveable state: {"model": ..., "optim": ...} (sharded tensors/DTensors)."""

    @abstractmethod
    def load_checkpoint_state(self, state: dict) -> None:
        """Apply what DCP loaded into the structure returned by checkpoint_state()."""

    @abstractmethod
    def optimizer_coverage(self) -> dict[str, bool]:
        """For every trainable parameter (by its checkpoint key): does the optimizer hold state."""

    @property
    @abstractmethod
    def lr_scheduler(self):
        """The torch LR scheduler (state_dict/load_state_dict)."""

    def param_count(self) -> int:
        return 0

    activation_offload = None   # engine.memory.activation_offload.ActivationOffloader, set by build()

    def _end_activation_offload(self) -> None:
        """After a micro-batch's backward: host buffers back to the pool, bytes to the tracker."""
        if self.activation_offload is None:
            return
        st = self.activation_offload.end_micro_batch()
        self.activation_stats = st
        if self.tracker is not None:
            self.tracker.record_bytes("activations_host", st.host_bytes)
            if st.tensors_kept and not st.tensors_offloaded:
                self.tracker.note(f"activation offload: engine.activation_offload_host_cache_limit_gb is below one "
                                  f"module's saved activations; {st.kept_bytes} B stayed on the device")

    def param_shapes(self) -> dict[str, dict]:
        """{checkpoint name: {"shape", "dtype"}} of every parameter (the manifest records it)."""
        return {}
