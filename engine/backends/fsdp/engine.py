"""FSDP2 backend: a transformers causal LM sharded with torch.distributed.fsdp.fully_shard.

Data parallel over all ranks (gloo on CPU, nccl on CUDA). Rank 0 reads (or seeds) the model,
the others build it on the meta device; each decoder layer and the root are sharded, every rank
receives its shards from rank 0 (engine/backends/fsdp/rank0_weights.py) and trains with AdamW on
them (DTensors). Gradients are reduced once per optimizer step (no sync on earlier
micro-batches), and every rank runs the same number of micro-batches so collectives line up.
A one-rank CPU run trains the plain model instead (``engine.fsdp_unit``, ``fsdp_units``).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist

from engine.algorithms.logprobs import position_log_probs, token_log_probs
from engine.backends.base import OffloadReport, TrainEngine
from engine.backends.fsdp.rank0_weights import (built_on_every_rank, full_state, reads_weights, receive_weights,
                                                 share_rank0_object, share_rank0_rng)
from engine.backends.fsdp.units import (check_fsdp_units, compile_decoder_blocks, decoder_blocks, eager_decoder_blocks,
                                        fsdp_units, set_gradient_sync, use_cpu_matmul)
from engine.backends.prompt_sharing import grouped_logits
from engine.backends.schedule import build_optimizer
from engine.batch import SequenceBatch
from engine.batching.microbatch import zero_weight_twin
from engine.batching.prompt_groups import group_prompts, to_response_columns


class FSDPEngine(TrainEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer = None
        self._scheduler = None
        # the update runs each distinct prompt once per micro-batch (same result as the plain
        # forward; bench/train_throughput.py --plain turns it off to compare)
        self.share_prompts = True
        self.lora_reference = None   # LoRA: {"rank", ..., "base_path", "base_sha256"} (engine.model.lora.inject)
        self.critic = None  # engine.backends.fsdp.critic.FSDPCritic (algorithm=ppo), set by the worker
        self.router_replay = None  # engine.moe.router_replay.RouterReplay, set by build()
        self.fused_kernels: dict[str, int] = {}  # kind -> modules swapped (engine.fused_kernels)
        self.onednn_linears = 0  # linear layers multiplying through oneDNN (engine.cpu_matmul)
        self.units = "layer"  # what FSDP2 wraps: layer, model or none (fsdp_units)

    # ---- build --------------------------------------------------------------------------
    def build(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from engine.model.build import build_hf_model

        c = self.cfg
        self.units = fsdp_units(c.engine, self.world_size, self.device, c.model.dtype)
        check_fsdp_units(self.units, self.world_size, c.model.dtype)
        reads = reads_weights(self.units, self.world_size)  # else meta modules, filled from rank 0
        shared = self.units != "none" and self.world_size > 1
        def build():
            return build_hf_model(c.model, self.model_path, self.vocab_size, c.trainer.seed,
                                  self.pad_token_id, self.eos_token_id, load_dtype=torch.float32, on_meta=not reads)

        model = built_on_every_rank(build) if shared else build()
        if c.model.dtype != "float32":  # keep fp32 masters; compute in the low precision
            model = model.float()
        if c.engine.gradient_checkpointing:
            if c.engine.activation_offload:  # checkpoint inputs then pass through the offload hooks
                from engine.memory.activation_offload import use_reentrant_checkpointing

                use_reentrant_checkpointing(model)
            else:
                from engine.model.grad_checkpointing import enable_checkpointing

                enable_checkpointing(model)
        ref = copy.deepcopy(model).eval().requires_grad_(False) if c.algorithm.kl_coef > 0 else None
        self.lora_reference = None
        if c.model.lora.rank:  # the reference stays the base model; the policy gets adapters
            from engine.model.lora import inject

            model, self.lora_reference = inject(model, c.model.lora, self.model_path, hash_weights=reads)
            if c.engine.gradient_checkpointing:
                model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need grads
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, c.model.dtype), reduce_dtype=torch.float32)
        for m in [model] + ([ref] if ref is not None else []):
            if self.units == "none":
                m.to(self.device)
                continue
            whole = full_state(m) if reads and shared else ({}, {})
            # no m.to(device) first: fully_shard moves each unit's parameters to the mesh's device as
            # it shards them, so a GPU holds one whole block at a time, not the whole fp32 model
            for layer in decoder_blocks(m) if self.units == "layer" else []:
                fully_shard(layer, mesh=self.mesh, mp_policy=mp,
                            reshard_after_forward=c.engine.reshard_after_forward)
            fully_shard(m, mesh=self.mesh, mp_policy=mp, reshard_after_forward=c.engine.reshard_after_forward)
            if shared:
                receive_weights(m, self.device, whole)
            del whole
        if shared:
            share_rank0_rng()
            if self.lora_reference is not None:
                self.lora_reference = share_rank0_object(self.lora_reference)
        self.model, self.ref_model = model, ref
        self.router_replay = None  # engine.moe.router_replay.RouterReplay (algorithm.router_replay on)
        if c.algorithm.router_replay != "off":
            from engine.moe.router_replay import attach

            self.router_replay = attach(model)  # the rollout records through the same hooks
        from engine.memory.activation_offload import make_activation_offloader

        names = {id(m): n for n, m in model.named_modules()}
        self.activation_offload = make_activation_offloader(
            model, c.engine, [names[id(m)] for m in decoder_blocks(model)], self.device)
        if c.engine.fused_lm_head:  # the output layer computes the log-probs (engine/backends/fused_head.py)
            from engine.errors import ConfigError
            from engine.backends.fused_head import unfusable_reason

            reason = unfusable_reason(model)
            if reason:
                raise ConfigError(f"engine.fused_lm_head=true cannot fuse this model's output layer: {reason}. "
                                  f"Set engine.fused_lm_head=false.", title="invalid config value")
        if c.engine.fused_kernels:  # RMSNorm and the MLP's activation (engine/model/fused_kernels.py)
            from engine.model.fused_kernels import use_fused_kernels

            self.fused_kernels = use_fused_kernels(model)
        self.onednn_linears = use_cpu_matmul(c.engine, self.device, model, ref)
        if c.engine.compile:  # each decoder block's forward: FSDP2's hooks stay eager around it
            compile_decoder_blocks(model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: adapters only
        self.optimizer, self._scheduler = build_optimizer(trainable, c.optim, self.total_updates)
        from engine.batching.buckets import make_bucket_policy

        # long-lived, so policy=learned sees every step; the longest sequence is its top boundary
        from engine.config.lengths import longest_sequence

        self.bucket_policy = make_bucket_policy(c.engine, max_length=longest_sequence(c))
        self._updates = 0

    def _share_prompts(self) -> bool:
        """The grouped forward runs the model twice per micro-batch, the second with a KV cache:
        not with compiled blocks (the cache object would go through dynamo), activation offload
        (its hooks expect one forward) or gradient checkpointing (transformers drops the
        prompt's KV cache in training then). With the fused output layer the prompt pass hands its
        last position to each sample inside the output layer (prompt_sharing.grouped_logits)."""
        e = self.cfg.engine
        return (self.share_prompts and not e.compile and self.activation_offload is None
                and not e.gradient_checkpointing)  # HF turns the KV cache off under GC

    def _replays(self) -> bool:
        return self.router_replay is not None and self.cfg.algorithm.router_replay == "replay"

    def _replay(self, mb: SequenceBatch, model=None, groups=None):
        """Replay ``mb``'s routing records in the policy's forwards (and backward's recomputation)
        inside the context, when algorithm.router_replay=replay; else nothing. ``groups``: the
        prompt-grouped layout's two forwards (prompts, then responses) get theirs."""
        from contextlib import nullcontext

        if not self._replays() or mb.routed_experts is None or (model is not None and model is not self.model):
            return nullcontext()
        if groups is not None:
            from engine.batching.prompt_groups import group_records

            return self.router_replay.replaying(*group_records(mb.routed_experts, groups), device=self.device)
        return self.router_replay.replaying(mb.routed_experts, device=self.device)

    def _groups(self, mb: SequenceBatch):
        """The prompt-grouped layout of ``mb`` (None: plain forward). Replay tells the grouped
        forwards apart by token count, so equal counts take the plain forward."""
        if not self._share_prompts():
            return None
        groups = group_prompts(mb, self.pad_token_id)
        if groups is not None and self._replays() and \
                groups.prompt_ids.numel() == groups.response_ids.shape[0] * groups.fed:
            return None
        return groups

    def _layouts(self, mbs) -> list:
        """Each micro-batch's prompt-grouped layout (each distinct prompt computed once,
        engine/batching/prompt_groups.py), or None for the plain forward. The grouped forward
        runs the model twice, so FSDP's collectives only line up when every rank takes the same
        layout for its i-th micro-batch: one that cannot group (no prompt repeats) makes it plain
        on every rank."""
        layouts = [self._groups(mb.batch) for mb in mbs]
        if self.world_size > 1:
            grouped = torch.tensor([g is not None for g in layouts], dtype=torch.int32)
            dist.all_reduce(grouped, op=dist.ReduceOp.MIN)
            layouts = [g if ok else None for g, ok in zip(layouts, grouped.tolist())]
        return layouts

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def lr_scheduler(self):
        return self._scheduler

    # ---- forward ------------------------------------------------------------------------
    def _forward_logits(self, model, mb: SequenceBatch) -> torch.Tensor:
        out = model(input_ids=mb.input_ids.to(self.device), attention_mask=mb.attention_mask.to(self.device),
                    use_cache=False)
        return out.logits

    def _micro_batches(self, batch: SequenceBatch, observe: bool = True):
        """This rank's micro-batches, padded to buckets, equal in number on every rank (so
        FSDP's collectives line up)."""
        from engine.batching.microbatch import split_micro_batches

        split = lambda k, obs: split_micro_batches(batch, self.cfg.engine, self.bucket_policy,  # noqa: E731
                                                   self.pad_token_id, min_micro_batches=k, observe=obs)
        mbs = split(1, False)
        if observe:
            self._observe_lengths(mbs)
        n = torch.tensor([len(mbs)])
        if self.world_size > 1:
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
        target = int(n)
        if len(mbs) < target:
            mbs = split(min(target, len(batch)), False)
        while len(mbs) < target:  # fewer rows than micro-batches: zero-weight twins
            mbs.append(zero_weight_twin(mbs[0]))
        return mbs

    def _measure(self, category: str, key=None):
        """Count what autograd saves in the block under ``category`` (yields the meter or None;
        ``key``: ``_saved_key``'s, a shape measured before is not measured again)."""
        from contextlib import nullcontext

        return self.tracker.saved_tensors(category, key) if self.tracker is not None else nullcontext()

    def _saved_key(self, mb: SequenceBatch, groups) -> tuple | None:
        """What a micro-batch's saved-for-backward bytes depend on (MemoryTracker.saved_tensors):
        the model, grad and train mode, the input shape, the prompt-grouped layout's shapes,
        whether any position is padding (the attention mask is then a tensor, else SDPA's causal
        flag), and with the fused output layer in the plain layout its response positions. None
        under activation offload, whose hooks count through the meter every time."""
        if self.activation_offload is not None or self.tracker is None:
            return None
        layout = None if groups is None else (tuple(groups.prompt_ids.shape), tuple(groups.response_ids.shape),
                                              groups.fed, bool(groups.prompt_mask.all()))
        # the fused output layer keeps only the response positions' hidden states (response_positions)
        fused = int(mb.response_mask[:, 1:].gt(0).sum()) if self.cfg.engine.fused_lm_head and groups is None else None
        return (id(self.model), torch.is_grad_enabled(), self.model.training, tuple(mb.input_ids.shape),
                bool(mb.attention_mask.all()), layout, fused)

    def _observe_lengths(self, mbs) -> None:
        """Feed every rank's natural micro-batch lengths to every rank's bucket policy, so all
        ranks fit the same boundaries (and so the same shapes)."""
        local = [(mb.natural_tokens // max(1, mb.num_rows), mb.num_rows) for mb in mbs]
        if self.world_size > 1:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, local)
            local = [x for part in gathered for x in part]
        self.bucket_policy.observe([n for n, _ in local], [w for _, w in local])

    def _routing_taken(self, rr, batch: SequenceBatch) -> torch.Tensor:
        return rr.take().reshape(batch.input_ids.shape + (rr.layout.layers, rr.layout.top_k))

    # ---- the update loop's hooks (engine/backends/base.py) -------------------------------
    def _token_log_probs(self, logits, input_ids, with_entropy: bool, entropy_grad: bool = True):
        return token_log_probs(logits, input_ids.to(self.device), self.cfg.rollout.temperature, with_entropy,
                               entropy_grad, chunk_tokens=self.cfg.engine.logprob_chunk_tokens)

    def _forward_scope(self, model, batch: SequenceBatch, layout=None):
        return self._replay(batch, model, layout)

    def _backward_scope(self, model, batch: SequenceBatch, layout, last: bool):
        # on a GPU FSDP2 reduce-scatters every micro-batch's gradients, so a rank holds its shard of
        # them: held unreduced until the last one, every GPU kept the whole model's fp32 gradients
        # through the accumulation (the memory estimate counts shards); on a CPU, where memory is the
        # host's, once per step (fewer gloo collectives)
        set_gradient_sync(model, last or self.device.type == "cuda")
        return self._replay(batch, model, layout)  # through backward: checkpointing recomputes them too

    def _clip_and_step(self, model, optimizer, clip: float) -> tuple[float, bool]:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        finite = bool(torch.isfinite(norm))  # the global norm: every rank decides the same
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm), finite

    def _micro_batch_loss(self, mb, groups, loss_fn, n_tokens: float, n_seqs: float):
        """The training forward of one micro-batch through ``loss_fn``: (loss, metrics)."""
        key = self._saved_key(mb.batch, groups)
        if self.cfg.engine.fused_lm_head:
            return self._fused_head_loss(mb, groups, loss_fn, n_tokens, n_seqs, key)
        with self._measure("activations", key) as meter:
            if self.activation_offload is not None:  # what stays on the device is counted there
                self.activation_offload.meter = meter
            logits = (grouped_logits(self.model, groups, self.device) if groups is not None
                      else self._forward_logits(self.model, mb.batch))
        if self.activation_offload is not None:
            self.activation_offload.meter = None  # counted; backward must not find the meter holding tensors
        lp_batch = to_response_columns(mb.batch, groups) if groups is not None else mb.batch
        lp_fn = position_log_probs if groups is not None else token_log_probs  # grouped: column j predicts id j
        ids = lp_batch.input_ids.to(self.device)
        with self._measure("logits", key and key + (loss_fn.needs_entropy,)) as meter:
            if meter is not None:
                meter.add(logits)
            # entropy: in the loss (a bonus) or only a metric (the same pass, no graph)
            lp, ent = lp_fn(logits, ids, self.cfg.rollout.temperature, with_entropy=True,
                            entropy_grad=loss_fn.needs_entropy, chunk_tokens=self.cfg.engine.logprob_chunk_tokens)
        return loss_fn(lp, ent, lp_batch.to(self.device), n_tokens, n_seqs)

    def _fused_head_loss(self, mb, groups, loss_fn, n_tokens: float, n_seqs: float, key):
        """engine.fused_lm_head: the forward's output layer yields each position's log-prob of
        the next token and entropy (engine/backends/fused_head.py); no logits are made, in the
        plain layout or the prompt-grouped one (``groups``). What the output layer keeps for
        backward (its input, the hidden states) counts as activations."""
        from engine.backends.fused_head import head_log_probs

        with self._measure("activations", key) as meter:
            if self.activation_offload is not None:
                self.activation_offload.meter = meter
            if groups is None:
                lp, ent = self._fused_head_log_probs(self.model, mb.batch, loss_fn.needs_entropy)
            else:
                e = self.cfg.engine
                out = grouped_logits(self.model, groups, self.device, head=lambda target, rows: head_log_probs(
                    self.model, target, self.cfg.rollout.temperature, e.logprob_chunk_tokens, loss_fn.needs_entropy,
                    rows=rows))
                lp, ent = out[..., 0], out[..., 1]
        if self.activation_offload is not None:
            self.activation_offload.meter = None
        lp_batch = to_response_columns(mb.batch, groups) if groups is not None else mb.batch
        return loss_fn(lp, ent, lp_batch.to(self.device), n_tokens, n_seqs)

    def _fused_head_log_probs(self, model, batch: SequenceBatch, entropy_grad: bool, with_entropy: bool = True):
        """(log-prob, entropy) [B, T] of ``batch`` from ``model``'s output layer, laid out as
        token_log_probs lays them out: position t holds input_ids[:, t]'s (the entropy None
        without ``with_entropy``). Only response tokens' are computed, what every consumer reads
        (the loss, the old and reference log-probs, the entropy): 0 at prompt positions, where the
        output layer does no work (``response_positions``)."""
        from torch.nn.functional import pad

        from engine.backends.fused_head import head_log_probs, response_positions

        ids = batch.input_ids.to(self.device)
        target = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # position t predicts t + 1; the last nothing
        where = response_positions(batch.response_mask).to(self.device, non_blocking=True)
        with head_log_probs(model, target, self.cfg.rollout.temperature, self.cfg.engine.logprob_chunk_tokens,
                            entropy_grad, with_entropy, positions=where):
            out = self._forward_logits(model, batch)
        return pad(out[:, :-1, 0], (1, 0)), (pad(out[:, :-1, 1], (1, 0)) if with_entropy else None)

    def _pass_log_probs(self, model, batch: SequenceBatch, with_entropy: bool):
        if not self.cfg.engine.fused_lm_head:
            return super()._pass_log_probs(model, batch, with_entropy)
        with self._forward_scope(model, batch):  # old and reference log-probs without the logits too
            return self._fused_head_log_probs(model, batch, entropy_grad=False, with_entropy=with_entropy)

    # ---- rollout ------------------------------------------------------------------------
    @contextmanager
    def generation_model(self):
        """Gather full weights once, keep them gathered while sampling (no collectives per
        token, so ranks that finish early cannot deadlock), then reshard."""
        from torch.distributed.fsdp import FSDPModule

        m = self.model
        m.eval()
        sharded = isinstance(m, FSDPModule)  # engine.fsdp_unit=none: the weights are whole already
        if sharded:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=True)
        try:
            with eager_decoder_blocks(m):
                yield m
        finally:
            if sharded:
                m.set_reshard_after_forward(self.cfg.engine.reshard_after_forward, recurse=True)
                for mod in m.modules():  # reshard() is not recursive: free every layer's gathered weights
                    if isinstance(mod, FSDPModule):
                        mod.reshard()

    def export_hf_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Every rank that ``keep``s them gets every tensor (a collective: all ranks call it),
        gathered one parameter at a time and copied to host, so the device holds one full tensor
        at most; a rank that does not keep them drops each as soon as it is gathered (its host
        never holds the whole model: the rollout worker's sync keeps rank 0's copy alone)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, value in self.model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if keep:
                out[name] = full.detach().to("cpu", copy=True)
            del full
        if not keep:
            return out
        if self.lora_reference is not None:
            out = self._merge_lora(out)
        return out

    def _merge_lora(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """LoRA: the base model's names and merged weights (W + B A alpha/r), which is what
        vLLM receives. ``full`` is already gathered on every rank: no further collective."""
        from engine.model.lora import base_name, merged_weights

        out = {base_name(k): v for k, v in full.items() if "lora_" not in k}
        out.update(merged_weights(self.model, full))
        return out

    # ---- memory -------------------------------------------------------------------------
    def _offloaded_models(self) -> list:
        """What param_offload moves: the policy, the reference (algorithm.kl_coef > 0) and the
        critic (algorithm=ppo), as the megatron engine and the memory estimate do."""
        return ([self.model] + ([self.ref_model] if self.ref_model is not None else [])
                + ([self.critic.model] if self.critic is not None else []))

    def _offloaded_optimizers(self) -> list:
        return [self.optimizer] + ([self.critic.optimizer] if self.critic is not None else [])

    def offload(self) -> OffloadReport:
        from engine.memory.offload import combine_reports, offload_optimizer_state, offload_params

        e = self.cfg.engine
        reports = []
        if e.param_offload:
            reports += [offload_params(m) for m in self._offloaded_models()]
        if e.optimizer_offload:
            reports += [offload_optimizer_state(o) for o in self._offloaded_optimizers()]
        self._offloaded = bool(reports)
        return combine_reports(*reports) if reports else OffloadReport()

    def onload(self) -> OffloadReport:
        from engine.memory.offload import combine_reports, onload_optimizer_state, onload_params

        if not self._offloaded:
            return OffloadReport()
        e = self.cfg.engine
        reports = []
        if e.param_offload:
            reports += [onload_params(m, self.device) for m in self._offloaded_models()]
        if e.optimizer_offload:
            reports += [onload_optimizer_state(o, self.device) for o in self._offloaded_optimizers()]
        self._offloaded = False
        return combine_reports(*reports)

    # ---- checkpoints --------------------------------------------------------------------
    def checkpoint_state(self, for_save: bool = False) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        from engine.checkpoint.fresh_optimizer import keep_fresh

        with keep_fresh(self.optimizer, for_save) as fix:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                                options=StateDictOptions(flatten_optimizer_state_dict=True))
        if self.lora_reference is not None:  # adapters only; the manifest names the base model and its hash
            model_sd = {k: v for k, v in model_sd.items() if "lora_" in k}
        state = {"model": model_sd, "optim": fix(optim_sd)}
        if self.critic is not None:
            state["critic"] = self.critic.checkpoint_state(for_save)
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True,
                                                strict=self.lora_reference is None))
        if self.critic is not None:
            self.critic.load_checkpoint_state(state["critic"])

    def optimizer_coverage(self) -> dict[str, bool]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: bool(self.optimizer.state.get(p))
                for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad}

    def param_shapes(self) -> dict[str, dict]:
        return {n: {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                for n, p in self.model.named_parameters()
                if self.lora_reference is None or p.requires_grad}  # LoRA: what the checkpoint holds
