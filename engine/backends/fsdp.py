"""FSDP2 backend: a transformers causal LM sharded with torch.distributed.fsdp.fully_shard.

Data parallel over all ranks (gloo on CPU, nccl on CUDA). Every rank builds the same
seeded model, shards each decoder layer and the root, and trains with AdamW on the local
shards (DTensors). Gradients are reduced once per optimizer step (no sync on earlier
micro-batches), and every rank runs the same number of micro-batches so collectives line up.
A one-rank CPU run trains the plain model instead (``engine.fsdp_unit``, ``fsdp_units``).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist

from engine.backends.base import OffloadReport, StepStats, TrainEngine, global_counts
from engine.algorithms.logprobs import token_log_probs
from engine.backends.schedule import build_optimizer
from engine.backends.prompt_sharing import grouped_logits, response_log_probs
from engine.batch import SequenceBatch
from engine.batching.prompt_groups import group_prompts, to_response_columns


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of any transformers model, found by class: the model's
    ``_no_split_modules`` names them (LlamaDecoderLayer, GPT2Block, GPTNeoXLayer, ...). Works
    through wrappers (PEFT) because it walks every submodule. Empty when the model does not
    declare them: the caller then shards the root only."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    if not names:
        return []
    # by MRO: fully_shard swaps a module's class for an FSDP subclass of it
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    # a declared class may also appear nested inside another declared one: keep the outermost
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]


def fsdp_units(engine_cfg, world_size: int, device: torch.device, dtype: str = "float32") -> str:
    """What ``engine.fsdp_unit`` wraps in FSDP2 on this run: ``layer`` (every decoder layer its
    own unit), ``model`` (one unit: one gather a pass instead of one a layer) or ``none`` (no
    FSDP2: the plain model). On one rank there is nothing to shard or reduce, and FSDP2's
    gather copies, hooks and DTensor dispatch are all cost: 5-20% of an update and the whole
    gathered copy of the weights at the issue-17 shape on a CPU (docs/benchmarks.md), so
    ``auto`` takes ``none`` on a one-rank CPU run of a float32 model (``model``, one unit, for a
    low-precision one: FSDP2's mixed-precision policy is what casts its compute copy). On GPUs
    and across ranks layers bound what is gathered at once. ``check_fsdp_units`` refuses an
    explicit ``none`` where FSDP2 is needed."""
    unit = getattr(engine_cfg, "fsdp_unit", "layer")
    if unit == "auto":
        if world_size == 1 and device.type == "cpu":
            return "none" if dtype == "float32" else "model"
        return "layer"
    return unit


def check_fsdp_units(units: str, world_size: int, dtype: str) -> None:
    """A clear error for ``engine.fsdp_unit=none`` where FSDP2 is needed."""
    from engine.errors import ConfigError

    if units != "none":
        return
    if world_size > 1:
        raise ConfigError(f"engine.fsdp_unit=none runs the plain model on one rank, but this run has {world_size} "
                          f"ranks, which FSDP2 shards over. Use engine.fsdp_unit=auto (or layer/model), or one rank.",
                          title="invalid config value")
    if dtype != "float32":
        raise ConfigError(f"engine.fsdp_unit=none keeps the parameters as they are, but model.dtype={dtype} computes "
                          f"in a low-precision copy that FSDP2's mixed-precision policy makes. Use engine.fsdp_unit=auto "
                          f"(or model/layer), or model.dtype=float32.", title="invalid config value")


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync`` (reduce gradients on this backward or not); a
    plain model (``engine.fsdp_unit=none``) has nothing to reduce."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def compile_decoder_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` the forward of every decoder block (engine.compile), as torchtitan and
    torchtune do under FSDP2: the root's forward and the hooks fully_shard puts around each block
    (gather before, free after, gradient reduction) stay eager, so a block computes on gathered
    weights. Compiling the root forward instead bypassed the root's hooks and handed the blocks
    sharded weights (a DTensor/tensor mix dynamo refused). One compiled graph serves every block
    of a model (their code is the same; parameters are inputs). Returns how many were compiled."""
    blocks = decoder_blocks(model)
    for block in blocks:
        block._rl_eager_forward = block.forward
        block.forward = torch.compile(block.forward, dynamic=False)
    return len(blocks)


def use_cpu_matmul(engine_cfg, device: torch.device, *models) -> int:
    """Route the linear layers of ``models`` (None skipped) through oneDNN when
    ``engine.cpu_matmul`` resolves to it on ``device`` (engine/model/onednn_linear.py); returns
    how many layers were swapped (0: torch's own ``F.linear``)."""
    from engine.model.onednn_linear import resolve, use_onednn_linears

    if resolve(getattr(engine_cfg, "cpu_matmul", "aten"), device) != "onednn":
        return 0
    return sum(use_onednn_linears(m) for m in models if m is not None)


@contextmanager
def eager_decoder_blocks(model: torch.nn.Module):
    """The blocks' own (uncompiled) forwards inside the block: generation feeds them a new shape
    at every token, which a ``dynamic=False`` graph would recompile for (then give up on)."""
    swapped = [(b, b.forward) for b in decoder_blocks(model) if hasattr(b, "_rl_eager_forward")]
    for b, _ in swapped:
        b.forward = b._rl_eager_forward
    try:
        yield model
    finally:
        for b, compiled in swapped:
            b.forward = compiled


class FSDPEngine(TrainEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer = None
        self._scheduler = None
        # the update runs each distinct prompt once per micro-batch (same result as the plain
        # forward; bench/train_throughput.py --plain turns it off to compare)
        self.share_prompts = True
        self.lora_reference = None   # LoRA: {"rank", ..., "base_path", "base_sha256"} (engine.model.lora.inject)
        self.critic = None  # engine.backends.critic.FSDPCritic (algorithm=ppo), set by the worker
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
        model = build_hf_model(c.model, self.model_path, self.vocab_size, c.trainer.seed,
                               self.pad_token_id, self.eos_token_id)
        if c.model.dtype != "float32":  # keep fp32 masters; compute in the low precision
            model = model.float()
        if c.engine.gradient_checkpointing:
            if c.engine.activation_offload:  # checkpoint inputs then pass through the offload hooks
                from engine.memory.activation_offload import use_reentrant_checkpointing

                use_reentrant_checkpointing(model)
            else:
                model.gradient_checkpointing_enable()
        ref = copy.deepcopy(model).eval().requires_grad_(False) if c.algorithm.kl_coef > 0 else None
        self.lora_reference = None
        if c.model.lora.rank:  # the reference stays the base model; the policy gets adapters
            from engine.model.lora import inject

            model, self.lora_reference = inject(model, c.model.lora, self.model_path)
            if c.engine.gradient_checkpointing:
                model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need grads
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, c.model.dtype), reduce_dtype=torch.float32)
        self.units = fsdp_units(c.engine, self.world_size, self.device, c.model.dtype)
        check_fsdp_units(self.units, self.world_size, c.model.dtype)
        for m in [model] + ([ref] if ref is not None else []):
            m.to(self.device)
            if self.units == "none":
                continue
            for layer in decoder_blocks(m) if self.units == "layer" else []:
                fully_shard(layer, mesh=self.mesh, mp_policy=mp,
                            reshard_after_forward=c.engine.reshard_after_forward)
            fully_shard(m, mesh=self.mesh, mp_policy=mp, reshard_after_forward=c.engine.reshard_after_forward)
        self.model, self.ref_model = model, ref
        self.router_replay = None  # engine.moe.router_replay.RouterReplay (algorithm.router_replay on)
        if c.algorithm.router_replay != "off":
            from engine.moe.router_replay import attach

            self.router_replay = attach(model)  # the rollout records through the same hooks
        from engine.memory.activation_offload import make_activation_offloader

        names = {id(m): n for n, m in model.named_modules()}
        self.activation_offload = make_activation_offloader(
            model, c.engine, [names[id(m)] for m in decoder_blocks(model)], self.device)
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
        self.bucket_policy = make_bucket_policy(c.engine, max_length=c.data.max_prompt_length
                                                + c.rollout.max_new_tokens)
        self._updates = 0

    def _share_prompts(self) -> bool:
        """The grouped forward runs the model twice per micro-batch, the second with a KV cache:
        not with compiled blocks (the cache object would go through dynamo), activation offload
        (its hooks expect one forward) or gradient checkpointing (transformers drops the
        prompt's KV cache in training then)."""
        return (self.share_prompts and not self.cfg.engine.compile and self.activation_offload is None
                and not self.cfg.engine.gradient_checkpointing)  # HF turns the KV cache off under it

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
            mbs.append(_zero_weight(mbs[0]))
        return mbs

    def _measure(self, category: str, key=None):
        """Count what autograd saves in the block under ``category`` (yields the meter or None;
        ``key``: ``_saved_key``'s, a shape measured before is not measured again)."""
        from contextlib import nullcontext

        return self.tracker.saved_tensors(category, key) if self.tracker is not None else nullcontext()

    def _saved_key(self, mb: SequenceBatch, groups) -> tuple | None:
        """What a micro-batch's saved-for-backward bytes depend on (MemoryTracker.saved_tensors):
        the model, grad and train mode, the input shape, the prompt-grouped layout's shapes, and
        whether any position is padding (the attention mask is then a tensor, else SDPA's causal
        flag). None under activation offload, whose hooks count through the meter every time."""
        if self.activation_offload is not None or self.tracker is None:
            return None
        layout = None if groups is None else (tuple(groups.prompt_ids.shape), tuple(groups.response_ids.shape),
                                              groups.fed, bool(groups.prompt_mask.all()))
        return (id(self.model), torch.is_grad_enabled(), self.model.training, tuple(mb.input_ids.shape),
                bool(mb.attention_mask.all()), layout)

    def _observe_lengths(self, mbs) -> None:
        """Feed every rank's natural micro-batch lengths to every rank's bucket policy, so all
        ranks fit the same boundaries (and so the same shapes)."""
        local = [(mb.natural_tokens // max(1, mb.num_rows), mb.num_rows) for mb in mbs]
        if self.world_size > 1:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, local)
            local = [x for part in gathered for x in part]
        self.bucket_policy.observe([n for n, _ in local], [w for _, w in local])

    @torch.no_grad()
    def compute_log_probs(self, batch: SequenceBatch, ref: bool = False, with_entropy: bool = False):
        model = self.ref_model if ref else self.model
        if model is None:
            raise RuntimeError("no reference model: algorithm.kl_coef is 0")
        model.eval()
        B, T = batch.input_ids.shape
        out = torch.zeros(B, T)
        ent_out = torch.zeros(B, T) if with_entropy else None
        for mb in self._micro_batches(batch, observe=False):
            with self._replay(mb.batch, model):
                logits = self._forward_logits(model, mb.batch)
            lp, ent = token_log_probs(logits, mb.batch.input_ids.to(self.device), self.cfg.rollout.temperature,
                                      with_entropy)
            k, real = mb.num_rows, mb.indices >= 0  # rows past k are bucket padding; -1 = zero-weight twin
            t = min(T, lp.shape[1])
            out[mb.indices[real], :t] = lp[:k][real, :t].float().cpu()
            if with_entropy:
                ent_out[mb.indices[real], :t] = ent[:k][real, :t].float().cpu()
        return out * batch.attention_mask, (ent_out * batch.attention_mask if with_entropy else None)

    @torch.no_grad()
    def routing_report(self, batch: SequenceBatch) -> dict:
        """Partial sums of the routing metrics (engine/moe/routing_metrics.py) on this rank's
        rows: the policy's forward once with its own routing (captured and compared to the
        rollout's records) and once replaying the records; log-probs of both against the
        rollout's."""
        from engine.moe.routing_metrics import RoutingSums, add_routing, gap_sums

        sums = RoutingSums()
        if self.router_replay is None or batch.routed_experts is None:
            return sums.to_dict()
        self.model.eval()
        rr = self.router_replay
        for mb in self._micro_batches(batch, observe=False):
            b = mb.batch
            ids = b.input_ids.to(self.device)
            real = mb.indices >= 0
            k = mb.num_rows
            with rr.recording():
                lp_own, _ = token_log_probs(self._forward_logits(self.model, b), ids, self.cfg.rollout.temperature)
                own = rr.take()
            with rr.replaying(b.routed_experts, device=self.device):
                lp_rep, _ = token_log_probs(self._forward_logits(self.model, b), ids, self.cfg.rollout.temperature)
            L, kk = rr.layout.layers, rr.layout.top_k
            own = own.reshape(b.input_ids.shape + (L, kk))[:k][real]
            add_routing(sums, own.reshape(-1, L, kk), b.routed_experts[:k][real].reshape(-1, L, kk))
            mask, ro = b.response_mask[:k][real], b.rollout_log_probs[:k][real]
            n, a, k3 = gap_sums(lp_own[:k][real].float().cpu(), ro, mask)
            _, a2, k32 = gap_sums(lp_rep[:k][real].float().cpu(), ro, mask)
            sums.response_tokens += n
            sums.abs_gap_no_replay += a
            sums.k3_no_replay += k3
            sums.abs_gap_replay += a2
            sums.k3_replay += k32
        return sums.to_dict()

    def train_step(self, batch: SequenceBatch, loss_fn) -> StepStats:
        """One optimizer step on this rank's share of a mini-batch."""
        stats = StepStats()
        n_tokens, n_seqs = global_counts(batch, None, self.world_size)  # of every row, skipped or not
        batch, sums = self._skip_idle_rows(batch, loss_fn, n_tokens, n_seqs)
        self.model.train()
        mbs = self._micro_batches(batch)
        layouts = self._layouts(mbs)
        for i, (mb, groups) in enumerate(zip(mbs, layouts)):
            set_gradient_sync(self.model, i == len(mbs) - 1)
            with self._replay(mb.batch, groups=groups):  # through backward: checkpointing recomputes them too
                loss, m = self._micro_batch_loss(mb, groups, loss_fn, n_tokens, n_seqs)
                loss.backward()
            self._end_activation_offload()
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            stats.tokens += int(mb.real_tokens)
            stats.padded_tokens += int(mb.padded_tokens)
            stats.shapes.add(tuple(mb.shape))
        clip = self.cfg.optim.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if self.tracker is not None:
            self.tracker.sample_state()  # grads are live only until the step below
        finite = bool(torch.isfinite(grad_norm))  # the global norm: every rank decides the same
        if finite:  # a nan/inf gradient would make every weight nan: the update is skipped (as verl does)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._scheduler.step()
        self._updates += 1
        self.bucket_policy.maybe_refresh(self._updates)
        stats.metrics = sums
        stats.replicated = {"grad_norm": float(grad_norm), "lr": self._scheduler.get_last_lr()[0],
                            "nonfinite_updates": 0.0 if finite else 1.0}
        return stats

    def _micro_batch_loss(self, mb, groups, loss_fn, n_tokens: float, n_seqs: float):
        """The training forward of one micro-batch through ``loss_fn``: (loss, metrics)."""
        key = self._saved_key(mb.batch, groups)
        with self._measure("activations", key) as meter:
            if self.activation_offload is not None:  # what stays on the device is counted there
                self.activation_offload.meter = meter
            logits = (grouped_logits(self.model, groups, self.device) if groups is not None
                      else self._forward_logits(self.model, mb.batch))
        lp_batch = to_response_columns(mb.batch, groups) if groups is not None else mb.batch
        lp_fn = response_log_probs if groups is not None else token_log_probs
        ids = lp_batch.input_ids.to(self.device)
        with self._measure("logits", key and key + (loss_fn.needs_entropy,)) as meter:
            if meter is not None:
                meter.add(logits)
            # entropy: in the loss (a bonus) or only a metric (from the same log-softmax, no graph)
            lp, ent = lp_fn(logits, ids, self.cfg.rollout.temperature, with_entropy=True,
                            entropy_grad=loss_fn.needs_entropy)
        return loss_fn(lp, ent, lp_batch.to(self.device), n_tokens, n_seqs)

    def _skip_idle_rows(self, batch: SequenceBatch, loss_fn, n_tokens: float, n_seqs: float):
        """(the rows to train on, the metric sums of the rows left out): rows whose advantage is 0
        everywhere train nothing (engine/backends/zero_advantage.py); their metrics come from a
        no-grad pass through the same loss function."""
        from engine.backends.zero_advantage import skippable, split_rows

        split = split_rows(batch, self.cfg.engine.skip_zero_advantage_rows and skippable(loss_fn))
        skipping = torch.tensor([len(split.skip)])
        if self.world_size > 1:
            dist.all_reduce(skipping, op=dist.ReduceOp.MAX)
        if not int(skipping):
            return batch, {}
        # every rank runs the no-grad pass so that its collectives line up; a rank that skips
        # nothing runs it on one row and drops the result
        idle = batch.select(split.skip or split.train[:1])
        sums = {"rows_skipped": float(len(split.skip))}
        self.model.train()  # the forward the update would have run, without its backward
        mbs = self._micro_batches(idle, observe=False)
        with torch.no_grad():
            for mb, groups in zip(mbs, self._layouts(mbs)):
                with self._replay(mb.batch, groups=groups):
                    _, metrics = self._micro_batch_loss(mb, groups, loss_fn, n_tokens, n_seqs)
                if split.skip:
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
        return batch.select(split.train), sums

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

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank gets every tensor (a collective: all ranks call it), gathered one
        parameter at a time and copied to host, so the device holds one full tensor at most."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, value in self.model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[name] = full.detach().to("cpu", copy=True)
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
        """What param_offload moves: the policy and the critic (algorithm=ppo)."""
        return [self.model] + ([self.critic.model] if self.critic is not None else [])

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
    def checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        if self.lora_reference is not None:  # adapters only; the manifest names the base model and its hash
            model_sd = {k: v for k, v in model_sd.items() if "lora_" in k}
        state = {"model": model_sd, "optim": optim_sd}
        if self.critic is not None:
            state["critic"] = self.critic.checkpoint_state()
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


def _zero_weight(mb):
    """A copy of ``mb`` whose rows count for nothing (loss and metrics 0), indices -1."""
    twin = copy.copy(mb)
    b = mb.batch
    out = {n: getattr(b, n).clone() for n in b.tensor_fields()}
    out["response_mask"] = torch.zeros_like(out["response_mask"])
    twin.batch = SequenceBatch(**out, extras=b.extras)
    twin.indices = torch.full_like(mb.indices, -1)
    twin.real_tokens = 0
    twin.padded_tokens = 0
    return twin

