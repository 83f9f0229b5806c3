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

The update loop (``train_step`` -> ``accumulate_and_step``) and the no-grad log-prob pass are
written once, here; the PPO critic's update runs through the same loop (engine/backends/critic.py).
A backend supplies hooks: how a batch splits into micro-batches (``_micro_batches``), one
micro-batch's forward through the loss (``_micro_batch_loss``), the logits of a forward
(``_forward_logits``, ``_token_log_probs``), and what differs around them (``_begin_pass``,
``_begin_accumulation``, ``_backward_scope``, ``_finish_gradients``, ``_clip_and_step``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engine.batch import SequenceBatch
from engine.memory.offload import OffloadReport  # noqa: F401  (re-exported: backends return it)
from engine.metric_sums import add_metrics

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
        self.dp_group = None                  # None: every rank (megatron: its data-parallel group)
        self._updates = 0                     # optimizer steps taken (the bucket policy refreshes on it)
        self.total_updates = cfg.trainer.total_steps * updates_per_step
        self.model = None                     # the trained policy (backend-wrapped)
        self.ref_model = None                 # frozen reference, when algorithm.kl_coef > 0
        self.bucket_policy = None             # engine.batching.buckets.BucketPolicy, set by build()
        self.tracker = None                   # engine.memory.tracker.MemoryTracker, set by the worker
        self._offloaded = False

    @abstractmethod
    def build(self) -> None:
        """Create model(s), wrap them for parallelism, create optimizer and LR scheduler."""

    # ---- the backend's hooks -------------------------------------------------------------
    @abstractmethod
    def _micro_batches(self, batch: SequenceBatch, observe: bool = True) -> list:
        """This rank's micro-batches of ``batch`` (engine.batching.microbatch.MicroBatch),
        padded to the bucket policy's lengths (``observe``: feed it the natural lengths)."""

    @abstractmethod
    def _forward_logits(self, model, batch: SequenceBatch) -> torch.Tensor:
        """[B, T, V] logits of ``model`` on ``batch`` (megatron: this rank's vocab slice)."""

    @abstractmethod
    def _token_log_probs(self, logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool,
                         entropy_grad: bool = True):
        """(log-probs [B, T], entropy [B, T] | None) of ``input_ids`` under ``logits``
        (engine/algorithms/logprobs.py; the entropy differentiable only when ``entropy_grad``)."""

    @abstractmethod
    def _micro_batch_loss(self, mb, layout, loss_fn: LossFn, n_tokens: float, n_seqs: float):
        """The training forward of one micro-batch through ``loss_fn``: (loss, metrics)."""

    @abstractmethod
    def _clip_and_step(self, model, optimizer, clip: float) -> tuple[float, bool]:
        """Clip ``model``'s gradients to ``clip`` (<= 0: no clipping), step ``optimizer`` unless
        the global norm is not finite (a nan/inf gradient would make every weight nan; verl
        skips it too), clear the gradients. Returns (global grad norm, finite)."""

    def _layouts(self, mbs) -> list:
        """Each micro-batch's forward layout for ``_micro_batch_loss`` (None: the plain one)."""
        return [None] * len(mbs)

    def _begin_pass(self, model) -> None:
        """Before the first forward of a pass over ``model`` (megatron: refresh FP8 weights)."""

    def _begin_accumulation(self, model) -> None:
        """Before the first backward of an optimizer step of ``model``."""

    def _forward_scope(self, model, batch: SequenceBatch, layout=None):
        """A context around a forward (and its backward) of ``batch`` (FSDP: routing replay)."""
        return nullcontext()

    def _backward_scope(self, model, batch: SequenceBatch, layout, last: bool):
        """A context around one micro-batch's forward and backward; ``last``: the step's final one
        (FSDP2 reduces gradients on it only)."""
        return self._forward_scope(model, batch, layout)

    def _finish_gradients(self, model) -> None:
        """After the last backward of a step (megatron: its DDP reduction)."""

    def _pass_log_probs(self, model, batch: SequenceBatch, with_entropy: bool):
        """A no-grad pass's log-probs (and entropy) of one micro-batch under ``model``: [B, T] each,
        position t that of input_ids[:, t] (FSDP with engine.fused_lm_head: from the output layer)."""
        with self._forward_scope(model, batch):
            logits = self._forward_logits(model, batch)
        return self._token_log_probs(logits, batch.input_ids, with_entropy)

    # ---- the passes, written once --------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, batch: SequenceBatch, ref: bool = False,
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log p(input_ids[:, t] | <t) as [B, T] (0 at t=0 and on padding), no grad.
        Read only where ``response_mask`` is 1: with engine.fused_lm_head the output layer computes
        response tokens alone, and every other position is 0."""
        model = self.ref_model if ref else self.model
        if model is None:
            raise RuntimeError("no reference model: algorithm.kl_coef is 0")
        model.eval()
        self._begin_pass(model)
        B, T = batch.input_ids.shape
        out = torch.zeros(B, T)
        ent_out = torch.zeros(B, T) if with_entropy else None
        for mb in self._micro_batches(batch, observe=False):
            lp, ent = self._pass_log_probs(model, mb.batch, with_entropy)
            k, real = mb.num_rows, mb.indices >= 0  # rows past k are bucket padding; -1 = zero-weight twin
            t = min(T, lp.shape[1])
            out[mb.indices[real], :t] = lp[:k][real, :t].float().cpu()
            if with_entropy:
                ent_out[mb.indices[real], :t] = ent[:k][real, :t].float().cpu()
        return out * batch.attention_mask, (ent_out * batch.attention_mask if with_entropy else None)

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> StepStats:
        """One optimizer step on this rank's share of a mini-batch: rows that train nothing
        left out, micro-batches accumulated, gradients reduced, clipped, stepped, the LR
        schedule advanced."""
        n_tokens, n_seqs = global_counts(batch, self.dp_group, self.dp_size)  # of every row, skipped or not
        batch, sums = self._skip_idle_rows(batch, loss_fn, n_tokens, n_seqs)
        self.model.train()
        mbs = self._micro_batches(batch)
        stats = StepStats()

        def loss_of(mb, layout):
            return self._micro_batch_loss(mb, layout, loss_fn, n_tokens, n_seqs)

        grad_norm, finite = self.accumulate_and_step(self.model, self._policy_optimizer(),
                                                     list(zip(mbs, self._layouts(mbs))), loss_of, sums,
                                                     self.cfg.optim.grad_clip, stats)
        self.lr_scheduler.step()
        self._updates += 1
        self.bucket_policy.maybe_refresh(self._updates)
        stats.metrics = sums
        stats.replicated = {"grad_norm": grad_norm, "lr": self.lr_scheduler.get_last_lr()[0],
                            "nonfinite_updates": 0.0 if finite else 1.0}
        return stats

    def accumulate_and_step(self, model, optimizer, micro_batches: list, loss_of, sums: dict, clip: float,
                            stats: StepStats | None = None) -> tuple[float, bool]:
        """The update loop of ``model`` (the policy, or the critic): each (micro-batch, layout)
        of ``micro_batches`` through ``loss_of`` -> (loss, metrics) and backward, metrics added
        into ``sums``; then the gradient reduction, clipping and ``optimizer``'s step.
        ``stats``: the policy's (token counts, shapes; memory sampled at the gradients' peak)."""
        self._begin_accumulation(model)
        self._accumulate(model, micro_batches, loss_of, sums, stats)
        return self._reduce_and_step(model, optimizer, clip, policy=stats is not None)

    def _accumulate(self, model, micro_batches: list, loss_of, sums: dict, stats: StepStats | None) -> None:
        """Forward and backward of each (micro-batch, layout), gradients added to what ``model``
        holds; the last one's backward reduces them across ranks (FSDP2 on a CPU: the only one)."""
        for i, (mb, layout) in enumerate(micro_batches):
            with self._backward_scope(model, mb.batch, layout, last=i == len(micro_batches) - 1):
                loss, metrics = loss_of(mb, layout)
                loss.backward()  # inside the scope: checkpointed blocks recompute under it
            if stats is not None:
                self._end_activation_offload()
                stats.tokens += int(mb.real_tokens)
                stats.padded_tokens += int(mb.padded_tokens)
                stats.shapes.add(tuple(mb.shape))
            add_metrics(sums, metrics)

    def _reduce_and_step(self, model, optimizer, clip: float, policy: bool = True,
                         scale: float = 1.0) -> tuple[float, bool]:
        """After the last backward: the gradient reduction, ``scale`` applied to every gradient
        (a streamed update's normaliser), clipping and ``optimizer``'s step."""
        self._finish_gradients(model)
        if scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        if policy and self.tracker is not None:
            self.tracker.sample_state()  # gradients are live only until the step
        norm, finite = self._clip_and_step(model, optimizer, clip)
        return float(norm), bool(finite and math.isfinite(norm))

    # ---- a streamed update (trainer.mode=streamed): the mini-batch arrives in chunks --------
    def stream_begin(self) -> None:
        """Start one optimizer step whose mini-batch arrives in chunks of whole prompt groups
        (``stream_chunk``) and whose size is known only at the end (``stream_finish``)."""
        self.model.train()
        self._begin_accumulation(self.model)
        self._streamed = (StepStats(), {})

    def stream_chunk(self, chunk: SequenceBatch, loss_fn: LossFn) -> None:
        """Forward and backward of this rank's share of one chunk. The loss is taken with both
        global counts at 1 (a sum over tokens or sequences, not yet a mean): ``stream_finish``
        divides the gradients and the metrics by the real counts, once every chunk has come."""
        stats, sums = self._streamed
        batch, idle = self._skip_idle_rows(chunk, loss_fn, 1.0, 1.0)
        add_metrics(sums, idle)
        self.model.train()
        mbs = self._micro_batches(batch)
        self._accumulate(self.model, list(zip(mbs, self._layouts(mbs))),
                         lambda mb, layout: self._micro_batch_loss(mb, layout, loss_fn, 1.0, 1.0), sums, stats)

    def stream_finish(self, n_tokens: float, n_seqs: float, loss_fn: LossFn) -> StepStats:
        """The streamed step's optimizer step: gradients divided by the count the loss
        aggregates over (``loss_fn.denominator``: response tokens or sequences of the whole
        mini-batch, every rank's), metrics by theirs (``loss_fn.metric_denominator``), then
        clipped and stepped as ``train_step`` does."""
        stats, sums = self._streamed
        self._streamed = None
        counts = {"tokens": max(n_tokens, 1.0), "seqs": max(n_seqs, 1.0)}
        grad_norm, finite = self._reduce_and_step(self.model, self._policy_optimizer(), self.cfg.optim.grad_clip,
                                                  scale=1.0 / counts[loss_fn.denominator])
        self.lr_scheduler.step()
        self._updates += 1
        self.bucket_policy.maybe_refresh(self._updates)
        for key in list(sums):
            per = loss_fn.metric_denominator(key)
            if per is not None:
                sums[key] /= counts[per]
        stats.metrics = sums
        stats.replicated = {"grad_norm": grad_norm, "lr": self.lr_scheduler.get_last_lr()[0],
                            "nonfinite_updates": 0.0 if finite else 1.0}
        return stats

    def _policy_optimizer(self):
        """What ``_clip_and_step`` steps for the policy (megatron: its optimizer wrapper)."""
        return self.optimizer

    def _skip_idle_rows(self, batch: SequenceBatch, loss_fn: LossFn, n_tokens: float, n_seqs: float):
        """(the rows to train on, the metric sums of the rows left out): rows whose advantage is 0
        everywhere train nothing (engine/backends/zero_advantage.py); their metrics come from a
        no-grad pass through the same loss function."""
        from engine.backends.zero_advantage import skippable, split_rows

        split = split_rows(batch, self.cfg.engine.skip_zero_advantage_rows and skippable(loss_fn))
        skipping = torch.tensor([len(split.skip)])
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(skipping, op=dist.ReduceOp.MAX)
        if not int(skipping):
            return batch, {}
        # every rank runs the no-grad pass so that its collectives line up; a rank that skips
        # nothing runs it on one row and drops the result
        idle = batch.select(split.skip or split.train[:1])
        sums = {"rows_skipped": float(len(split.skip))}
        self.model.train()  # the forward the update would have run, without its backward
        self._begin_pass(self.model)
        mbs = self._micro_batches(idle, observe=False)
        with torch.no_grad():
            for mb, layout in zip(mbs, self._layouts(mbs)):
                with self._forward_scope(self.model, mb.batch, layout):
                    _, metrics = self._micro_batch_loss(mb, layout, loss_fn, n_tokens, n_seqs)
                if split.skip:
                    add_metrics(sums, metrics)
        return batch.select(split.train), sums

    # ---- rollout ------------------------------------------------------------------------
    @abstractmethod
    @contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        """A full-weight causal LM (HF forward signature, KV cache) for sampling."""

    @abstractmethod
    def export_hf_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full, unsharded weights under Hugging Face names (for vLLM sync and export). A
        collective: every rank calls it; a rank that does not ``keep`` them gets ``{}`` (and, where
        the engine can, never holds them all at once)."""

    router_replay = None  # engine/moe/router_replay.py (FSDP) or megatron/routing_replay.py, set by build()

    @torch.no_grad()
    def routing_report(self, batch: SequenceBatch) -> dict:
        """Partial sums of the MoE routing metrics (engine/moe/routing_metrics.py) on this rank's
        rows: the policy's forward with its own routing (captured, compared to the rollout's
        records) and replaying the records; log-probs of both against the rollout's. None without
        routing replay."""
        from engine.moe.routing_metrics import RoutingSums, add_routing, gap_sums

        sums = RoutingSums()
        rr = self.router_replay
        if rr is None or batch.routed_experts is None:
            return sums.to_dict()
        self.model.eval()
        self._begin_pass(self.model)
        for mb in self._micro_batches(batch, observe=False):
            b = mb.batch
            real, k = mb.indices >= 0, mb.num_rows
            with rr.recording():
                lp_own, _ = self._token_log_probs(self._forward_logits(self.model, b), b.input_ids, False)
                own = self._routing_taken(rr, b)  # [B, T, layers, top-k]
            with rr.replaying(b.routed_experts, device=self.device):
                lp_rep, _ = self._token_log_probs(self._forward_logits(self.model, b), b.input_ids, False)
            L, kk = own.shape[-2:]
            add_routing(sums, own[:k][real].reshape(-1, L, kk), b.routed_experts[:k][real].reshape(-1, L, kk))
            mask, ro = b.response_mask[:k][real], b.rollout_log_probs[:k][real]
            n, a, k3 = gap_sums(lp_own[:k][real].float().cpu(), ro, mask)
            _, a2, k32 = gap_sums(lp_rep[:k][real].float().cpu(), ro, mask)
            sums.response_tokens += n
            sums.abs_gap_no_replay += a
            sums.k3_no_replay += k3
            sums.abs_gap_replay += a2
            sums.k3_replay += k32
        return (sums if self._reports_routing() else RoutingSums()).to_dict()

    def _routing_taken(self, rr, batch: SequenceBatch) -> torch.Tensor:
        """The experts the recording forward chose, [B, T, layers, top-k]."""
        raise NotImplementedError(f"{type(self).__name__} records no routing")

    def _reports_routing(self) -> bool:
        """Whether this rank's routing sums count (megatron: one TP rank per data-parallel group)."""
        return True

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
    def checkpoint_state(self, for_save: bool = False) -> dict:
        """DCP-saveable state: {"model": ..., "optim": ...} (sharded tensors/DTensors). As the
        template a checkpoint loads into (``for_save`` false), a fresh optimizer has entries for
        every parameter; for a save (``for_save``), an optimizer that has not stepped yet is left
        as it was and saved as fresh (FSDP: step 0, zero moments; megatron: without its entries,
        which resume backfills): engine/checkpoint/fresh_optimizer.py."""

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
