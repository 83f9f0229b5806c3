"""Megatron backend: a megatron-core ``GPTModel`` with tensor + data parallelism behind
``TrainEngine``, so the trainer, rollout, GRPO, checkpoints, resume and offload work as on FSDP2.

Layout. ``torch.distributed`` is already initialised by the worker (gloo on CPU, nccl on
CUDA); ``parallel_state`` carves it into TP groups of consecutive ranks and DP groups across
them. ``dp_rank``/``dp_size`` tell the trainer how to shard data: the TP ranks of one DP group
receive the same rows and compute the same thing (each on its slice of the weights). Pipeline
and context parallelism are refused with a ConfigError (not implemented here).

MoE (Mixtral). Each layer's experts are split over ``engine.expert_model_parallel_size`` ranks
of the data-parallel group (TP = 1); the allgather dispatcher (CPU; alltoall on CUDA) gathers
every EP rank's tokens in each MoE layer, so the EP ranks run the same number of forwards of the
same shape (``_micro_batches`` agrees on both). Routing replay goes through megatron-core's
per-router ``RouterReplay`` (routing_replay.py).

Weights. The policy is first built as the same transformers model the FSDP backend builds
(``engine.model.build.build_hf_model``: a local HF directory, or the seeded tiny model), then
converted into this TP rank's megatron layout (``hf_convert``). Both backends therefore start
from identical weights, and that HF model object is kept as the full-weight generation model
(refreshed from ``export_hf_state_dict()`` after every update).

Gradients. megatron DDP accumulates into fp32 ``main_grad`` buffers and *averages* them over
DP ranks, like FSDP; the trainer's ``PolicyLoss(world_size=dp_size)`` undoes that mean, so the
result is the global-mini-batch gradient. Then ``MainGradAdamW`` (CPU) or megatron's optimizer
(CUDA) clips and steps (see optimizer.py).

Metrics. The TP ranks of a DP group report the same partial sums and token counts; the driver
adds them over DP groups, one rank each (world-size rules: engine/interfaces.py).

Checkpoints. Keys are Hugging Face names (the FSDP backend's keys): ``model.<hf name>`` is the
full fp32 main weight, the optimizer state is flattened like
``torch.distributed.checkpoint.state_dict``'s ``flatten_optimizer_state_dict`` output
(``state.<hf name>.exp_avg`` ...). Every rank offers full tensors; DCP writes each key once.
Loading slices each rank's shard out of full tensors, so any TP/DP layout can resume any other
(and an FSDP checkpoint); the conversion is sharded_state.py, shared with the PPO critic
(critic.py). See docs/megatron.md.
"""

from __future__ import annotations

import logging
import math
import warnings
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from engine.backends.base import OffloadReport, StepStats, TrainEngine
from engine.batch import SequenceBatch
from engine.errors import ConfigError

log = logging.getLogger("rl.megatron")

# megatron-core warns at import that Apex/TE are absent; expected on CPU, noise in every run
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine and Apex) (is|are) not installed.*")


class MegatronEngine(TrainEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes: list[str] = []
        self.opt = None            # MainGradAdamW | MegatronOptimizer
        self._gen_model = None     # transformers model with full weights, for sampling
        self._gen_stale = False
        self.use_te = False        # Transformer-Engine layer spec (set by build)
        # self.model: megatron DDP(GPTModel); self.ref_model: GPTModel, frozen

    @property
    def optimizer(self):
        """What holds the optimizer state (for memory tracking and offload): the torch AdamW
        on CPU, megatron-core's optimizer on CUDA."""
        if self.opt is None:
            return None
        return self.opt.megatron if hasattr(self.opt, "megatron") else self.opt.optimizer

    # ---- build --------------------------------------------------------------------------
    def _note(self, msg: str) -> None:
        self.notes.append(msg)
        log.warning(msg)

    def _parallel_layout(self) -> tuple[int, bool]:
        e = self.cfg.engine
        tp = int(getattr(e, "tensor_model_parallel_size", 1))
        ep = int(getattr(e, "expert_model_parallel_size", 1))
        if (self.world_size // max(tp, 1)) % ep:
            raise ConfigError(f"engine.expert_model_parallel_size ({ep}) must divide the data-parallel ranks "
                              f"(trainer.nprocs / tensor_model_parallel_size = {self.world_size // max(tp, 1)}).",
                              title="invalid parallel layout")
        pp = int(getattr(e, "pipeline_model_parallel_size", 1))
        cp = int(getattr(e, "context_parallel_size", 1))
        if pp != 1:
            raise ConfigError("engine.pipeline_model_parallel_size > 1 is not supported by the megatron backend "
                              "yet; set it to 1 (use tensor parallelism and data parallelism).",
                              title="unsupported parallel layout")
        if cp != 1:
            raise ConfigError("engine.context_parallel_size > 1 is not supported by the megatron backend yet; "
                              "set it to 1.", title="unsupported parallel layout")
        if self.world_size % tp:
            raise ConfigError(f"trainer.nprocs ({self.world_size}) must be a multiple of "
                              f"engine.tensor_model_parallel_size ({tp}).", title="invalid parallel layout")
        sp = bool(getattr(e, "sequence_parallel", False))
        if sp and tp == 1:
            self._note("engine.sequence_parallel is off: it needs tensor_model_parallel_size > 1")
            sp = False
        if sp and not self.use_te:
            self._note("engine.sequence_parallel is off: megatron's local (non-Transformer-Engine) layers "
                       "do not support it")
            sp = False
        return tp, sp

    def _init_parallel_state(self, tp: int, ep: int = 1) -> None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            if (ps.get_tensor_model_parallel_world_size() == tp
                    and ps.get_pipeline_model_parallel_world_size() == 1
                    and ps.get_expert_model_parallel_world_size() == ep):
                return
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                     expert_model_parallel_size=ep)

    def build(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from engine.backends.megatron import cpu_shim
        from engine.backends.megatron.fp8_shapes import check_fp8_shapes
        from engine.backends.megatron.hf_convert import hf_to_megatron, param_mappings
        from engine.backends.megatron.model import (arch_from_hf_config, build_gpt_model, check_parallel_layout,
                                                    fusion_choices, te_available, transformer_config)
        from engine.model.build import build_hf_model

        c = self.cfg
        if not dist.is_initialized():
            raise RuntimeError("MegatronEngine.build() needs torch.distributed initialised first")
        on_gpu = self.device.type == "cuda"
        if not on_gpu and torch.cuda.is_available():
            raise ConfigError("engine=megatron with trainer.device=cpu on a machine with CUDA is not supported "
                              "(megatron-core would place tensors on the GPU); use trainer.device=cuda or "
                              "engine=fsdp.", title="unsupported device")
        cpu_shim.apply()  # no-op when CUDA is available
        if not on_gpu:   # a CUDA stream tuning hint, meaningless on CPU
            warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
        self.use_te = on_gpu and te_available()
        if c.engine.fp8 and not self.use_te:
            raise ConfigError("engine.fp8=true needs Transformer-Engine and a CUDA device; turn engine.fp8 off "
                              "or install transformer-engine on a GPU machine.", title="unsupported option")
        if c.engine.compile:
            self._note("engine.compile is ignored by the megatron backend")
        if c.engine.fused_kernels:
            self._note("engine.fused_kernels is ignored by the megatron backend (megatron-core's layers have their own)")
        tp, sp = self._parallel_layout()
        ep = int(getattr(c.engine, "expert_model_parallel_size", 1))
        self._init_parallel_state(tp, ep)
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), tp
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        with torch.random.fork_rng(devices=[]):   # megatron reseeds "CUDA" (= CPU via the shim)
            tensor_parallel.model_parallel_cuda_manual_seed(c.trainer.seed)

        hf = build_hf_model(c.model, self.model_path, self.vocab_size, c.trainer.seed,
                            self.pad_token_id, self.eos_token_id)
        self.arch = arch_from_hf_config(hf.config, fused_norms=self.use_te)
        check_parallel_layout(self.arch, tp, ep)
        if c.engine.fp8:
            check_fp8_shapes(self.arch, tp)  # before TE's first forward asserts on a tensor's dims
        self.ep_size = ep
        self.ep_rank = ps.get_expert_model_parallel_rank() if ep > 1 else 0
        self.ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
        self.dtype = getattr(torch, c.model.dtype)
        replay = self.arch.is_moe and c.algorithm.router_replay != "off"
        fusions, fusion_notes = fusion_choices(on_gpu, self.use_te)
        for note in fusion_notes:
            self._note(note)
        self.tcfg = transformer_config(self.arch, dtype=self.dtype, tp=tp, sequence_parallel=sp, on_gpu=on_gpu,
                                       fp8=c.engine.fp8, recompute=c.engine.gradient_checkpointing, ep=ep,
                                       aux_loss_coef=float(getattr(c.engine, "moe_aux_loss_coef", 0.0)),
                                       z_loss_coef=float(getattr(c.engine, "moe_z_loss_coef", 0.0)),
                                       routing_replay=replay, fusions=fusions)
        self.mappings = param_mappings(self.arch, ep_rank=self.ep_rank, ep_size=ep)
        hf_sd = {k: v.detach() for k, v in hf.named_parameters()}
        local = hf_to_megatron(hf_sd, self.arch, self.tp_rank, tp, ep_rank=self.ep_rank, ep_size=ep)

        def make() -> torch.nn.Module:
            m = build_gpt_model(self.arch, self.tcfg, self.use_te)
            params = dict(m.named_parameters())
            if set(params) != set(local):
                raise RuntimeError(f"megatron parameter names differ from the HF mapping: "
                                   f"{sorted(set(params) ^ set(local))}")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(local[name])
            return m.to(self.device)

        gpt = make()
        ref = make().eval().requires_grad_(False) if c.algorithm.kl_coef > 0 else None
        self.router_replay = None  # routing_replay.MegatronRoutingReplay (algorithm.router_replay on)
        if replay:
            from engine.backends.megatron.routing_replay import MegatronRoutingReplay

            self.router_replay = MegatronRoutingReplay(gpt)
        self._gen_model = hf.eval()
        self._gen_model.requires_grad_(False)
        del hf_sd, local

        use_dist_opt = on_gpu and bool(getattr(c.engine, "use_distributed_optimizer", False))
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=use_dist_opt)
        self.model = DistributedDataParallel(self.tcfg, ddp_cfg, gpt)
        from engine.memory.activation_offload import make_activation_offloader

        # with full recompute, megatron's checkpoint keeps each layer chunk's inputs, saved by
        # the transformer block (outside the layers): offload at that level
        self.activation_offload = make_activation_offloader(
            gpt, c.engine, ["decoder"] if c.engine.gradient_checkpointing else ["decoder.layers.*"], self.device)
        self.ref_model = ref
        self._params = dict(self.model.module.named_parameters())
        from engine.backends.megatron.sharded_state import ShardedState

        self.sharded = ShardedState(self.mappings, self._params, self.arch, self.tp_rank, tp, self.tp_group,
                                    self.device, ep_size=ep, ep_group=self.ep_group)
        plist = [self._params[m.megatron_name] for m in self.mappings]
        if on_gpu:
            from engine.backends.megatron.optimizer import MegatronOptimizer

            self.opt = MegatronOptimizer(self.model, plist, c.optim, self.total_updates, self.dtype, use_dist_opt)
        else:
            from engine.backends.megatron.optimizer import MainGradAdamW

            experts = frozenset(self._params[m.megatron_name] for m in self.mappings if m.is_expert)
            self.opt = MainGradAdamW(plist, c.optim, self.total_updates,
                                     ps.get_model_parallel_group(), self.tp_rank, experts, self.ep_group)
        from engine.batching.buckets import make_bucket_policy

        # long-lived (policy=learned sees every step); its top boundary is the longest sequence,
        # as make_bucket_policy's docstring asks for the padded layout
        from engine.config.lengths import longest_sequence

        longest = longest_sequence(c)
        self.bucket_policy = make_bucket_policy(self._engine_cfg(), max_length=longest)

    def _engine_cfg(self):
        """The engine config as this backend runs it (sequence parallel as actually used)."""
        return replace(self.cfg.engine, sequence_parallel=bool(self.tcfg.sequence_parallel))

    def param_count(self) -> int:
        return self.sharded.param_count()

    def param_shapes(self) -> dict[str, dict]:
        """Full (unsharded) shapes under HF names, as the manifest records them."""
        return self.sharded.param_shapes()

    @property
    def lr_scheduler(self):
        return self.opt.scheduler

    # ---- forward ------------------------------------------------------------------------
    def _forward_logits(self, model, batch: SequenceBatch) -> torch.Tensor:
        """[B, T] ids -> [B, T, V/tp] logits (this rank's vocab slice)."""
        b, t = batch.input_ids.shape
        ids = batch.input_ids.to(self.device)
        pos = torch.arange(t, device=self.device).unsqueeze(0).expand(b, -1)
        # causal mask passed explicitly: megatron's default builds it with device="cuda"; TE
        # layers apply causal masking themselves
        mask = None if self.use_te else torch.triu(torch.ones(t, t, dtype=torch.bool, device=self.device), 1)[None, None]
        return model(ids, pos, attention_mask=mask)

    @staticmethod
    def _refresh_fp8_weight_cache(model) -> None:
        """Transformer-Engine layers quantise their weights on the first micro-batch and reuse
        that FP8 copy until told otherwise (megatron's pipeline schedule does this per step; we
        do not use that schedule). Call before the first forward of every pass: the weights
        may have changed. No-op without FP8."""
        inner = getattr(model, "module", model)
        if hasattr(inner, "set_is_first_microbatch"):
            inner.set_is_first_microbatch()

    def _token_log_probs(self, logits, ids, with_entropy: bool, entropy_grad: bool = True):
        """Over this rank's vocabulary slice (engine/algorithms/logprobs.py: three all-reduces
        over the tensor-parallel group; no rank ever holds the whole vocabulary's logits)."""
        from engine.algorithms.logprobs import token_log_probs

        v_local = logits.shape[-1]
        return token_log_probs(logits, ids.to(self.device), self.cfg.rollout.temperature, with_entropy, entropy_grad,
                               chunk_tokens=self.cfg.engine.logprob_chunk_tokens,
                               vocab_start=self.tp_rank * v_local, vocab_size=self.arch.vocab_size,
                               group=self.tp_group if self.tp_size > 1 else None)

    def _micro_batches(self, batch: SequenceBatch, observe: bool = True):
        """Micro-batches of this DP group's rows. Dense models need no agreement across DP
        ranks: megatron DDP reduces gradients once, in finish_grad_sync(). With experts split
        over EP ranks every MoE layer all-gathers the EP ranks' tokens, so those ranks run as
        many micro-batches (zero-weight twins where one has fewer rows) of one shape each
        (empty rows and pad columns added)."""
        from engine.batching.microbatch import pad_micro_batch, split_micro_batches, zero_weight_twin

        split = lambda k: split_micro_batches(batch, self._engine_cfg(), self.bucket_policy,  # noqa: E731
                                              self.pad_token_id, min_micro_batches=k, observe=observe and k == 1)
        mbs = split(1)
        if self.ep_size == 1:
            return mbs
        n = torch.tensor([len(mbs)])
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.ep_group)
        target = int(n)
        if len(mbs) < target:
            mbs = split(min(target, len(batch)))
        while len(mbs) < target:
            mbs.append(zero_weight_twin(mbs[0]))
        shapes = torch.tensor([list(mb.batch.input_ids.shape) for mb in mbs])
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=self.ep_group)
        return [pad_micro_batch(mb, int(r), int(w), self.pad_token_id) for mb, (r, w) in zip(mbs, shapes.tolist())]

    def _measure(self, category: str):
        from contextlib import nullcontext

        return self.tracker.saved_tensors(category) if self.tracker is not None else nullcontext()

    # ---- the update loop's hooks (engine/backends/base.py) -------------------------------
    def _begin_pass(self, model) -> None:
        self._refresh_fp8_weight_cache(model)

    def _replays(self) -> bool:
        return self.router_replay is not None and self.cfg.algorithm.router_replay == "replay"

    def _forward_scope(self, model, batch: SequenceBatch, layout=None):
        """The rollout's routing replayed in the policy's forward (and, kept open through the
        backward, in megatron's recomputation); the reference model routes by itself."""
        from contextlib import nullcontext

        if not self._replays() or batch.routed_experts is None or model is not self.model:
            return nullcontext()
        return self.router_replay.replaying(batch.routed_experts, device=self.device)

    def _routing_taken(self, rr, batch: SequenceBatch) -> torch.Tensor:
        return rr.take(*batch.input_ids.shape)

    def _reports_routing(self) -> bool:
        return self.tp_rank == 0  # the TP ranks of a DP group saw the same rows: one reports them

    def _begin_accumulation(self, model) -> None:
        model.zero_grad_buffer()
        self._refresh_fp8_weight_cache(model)

    def _micro_batch_loss(self, mb, layout, loss_fn, n_tokens: float, n_seqs: float):
        with self._measure("activations") as meter:
            if self.activation_offload is not None:  # what stays on the device is counted there
                self.activation_offload.meter = meter
            logits = self._forward_logits(self.model, mb.batch)
        if self.activation_offload is not None:
            self.activation_offload.meter = None  # counted; backward must not find the meter holding tensors
        if self.tracker is not None:
            self.tracker.record_tensors("logits", logits)
        lp, ent = self._token_log_probs(logits, mb.batch.input_ids, True, entropy_grad=loss_fn.needs_entropy)
        return loss_fn(lp, ent, mb.batch.to(self.device), n_tokens, n_seqs)

    def _finish_gradients(self, model) -> None:
        # DP all-reduce of main_grad (finish_grad_sync) plus, under sequence parallelism, the
        # TP all-reduce of norm weights that each saw only a slice of the sequence
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([model])

    def _clip_and_step(self, model, optimizer, clip: float) -> tuple[float, bool]:
        norm = float(optimizer.step(clip))  # MainGradAdamW / MegatronOptimizer: clip, step (skipped on inf/nan)
        return norm, math.isfinite(norm)

    def _policy_optimizer(self):
        return self.opt

    def train_step(self, batch: SequenceBatch, loss_fn) -> StepStats:
        stats = super().train_step(batch, loss_fn)
        self._gen_stale = True  # the generation model's weights are refreshed before the next rollout
        return stats

    # ---- rollout / export ---------------------------------------------------------------
    def export_hf_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        full = self.sharded.gather_hf(lambda p: p)  # a collective on every rank, kept or not
        return full if keep else {}

    @contextmanager
    def generation_model(self):
        """The full-weight transformers model (every rank), refreshed after each update."""
        m = self._gen_model
        if self._gen_stale:
            sd = self.export_hf_state_dict()
            missing, unexpected = m.load_state_dict(sd, strict=False)
            tied = {"lm_head.weight"} if self.arch.tie_word_embeddings else set()
            if unexpected or set(missing) - tied:
                raise RuntimeError(f"generation model sync: missing {missing}, unexpected {unexpected}")
            self._gen_stale = False
        if self.device.type == "cuda" and next(m.parameters()).device != self.device:
            m.to(self.device)
        m.eval()
        yield m

    # ---- memory -------------------------------------------------------------------------
    def _param_modules(self) -> list:
        critic = self.critic.model if self.critic is not None else None
        return [x for x in (self.model, self.ref_model, self._gen_model, critic) if x is not None]

    def offload(self) -> OffloadReport:
        """Params (and megatron's grad buffers) of the policy, reference, generation copy and
        critic (algorithm=ppo) to host; FP8 workspaces cleared on every param offload
        (offload_params does it via engine.memory.fp8_workspaces.clear_fp8_workspaces); the
        policy's and the critic's optimizer state to host."""
        from engine.memory.offload import combine_reports, offload_optimizer_state, offload_params

        reports = []
        if self.cfg.engine.param_offload:
            reports += [offload_params(m) for m in self._param_modules()]
        if self.cfg.engine.optimizer_offload:
            reports += [offload_optimizer_state(o) for o in self._optimizer_objects()]
        self._offloaded = True
        return combine_reports(*reports)

    def onload(self) -> OffloadReport:
        from engine.memory.offload import combine_reports, onload_optimizer_state, onload_params

        if not self._offloaded:
            return OffloadReport()
        reports = []
        if self.cfg.engine.param_offload:
            reports += [onload_params(m, self.device) for m in self._param_modules()]
        if self.cfg.engine.optimizer_offload:
            reports += [onload_optimizer_state(o, self.device) for o in self._optimizer_objects()]
        self._offloaded = False
        return combine_reports(*reports)

    def _optimizer_objects(self) -> list:
        mine = [self.opt.megatron] if hasattr(self.opt, "megatron") else self.opt.torch_optimizers()
        return mine + (self.critic.optimizer_objects() if self.critic is not None else [])

    # ---- checkpoints --------------------------------------------------------------------
    def checkpoint_state(self, for_save: bool = False) -> dict:
        """{"model": {hf name: full fp32 tensor}, "optim": flattened AdamW state by hf name}, and
        the critic's under "critic" (algorithm=ppo). Collective over all ranks (TP gathers; DP
        gathers under DistributedOptimizer). Layout: sharded_state.py."""
        state = self.sharded.checkpoint_state(self.opt, for_save)
        if self.critic is not None:
            state["critic"] = self.critic.checkpoint_state(for_save)
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        """Slice this rank's TP shard out of the full tensors DCP loaded."""
        self.sharded.load_checkpoint_state(self.opt, state)
        if self.critic is not None:
            self.critic.load_checkpoint_state(state["critic"])
        self._gen_stale = True

    def optimizer_coverage(self) -> dict[str, bool]:
        """Collective-free (rank 0 alone calls it): HF name -> does AdamW hold state for it."""
        return self.sharded.optimizer_coverage(self.opt)
