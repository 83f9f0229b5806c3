"""The megatron backend's optimizer: one interface, two implementations.

megatron-core DDP accumulates every parameter's gradient into ``param.main_grad`` (a view
into a contiguous fp32 buffer) and reduces those buffers over data-parallel ranks in
``finish_grad_sync()``. What steps the weights then depends on the device:

* ``MainGradAdamW`` (CPU, and anywhere megatron's own optimizers cannot run): torch AdamW
  (``engine.backends.schedule.build_optimizer``, the same optimizer and LR schedule as the
  FSDP backend) over fp32 main params. For fp32 models the main param *is* the model param;
  for bf16 models it is an fp32 copy, written back after each step. ``main.grad`` is pointed
  at ``main_grad``; the global norm counts tensor-parallel-duplicated params (norms) once and
  all-reduces over the model-parallel group, then clips like ``torch.nn.utils.clip_grad_norm_``.
  MoE experts split over expert-parallel ranks add their squares over the EP group (each rank
  holds different experts; the rest is replicated over those ranks and counted once).
  Every data-parallel replica sees the same reduced ``main_grad`` and takes the same step.
* ``MegatronOptimizer`` (CUDA): ``megatron.core.optimizer.get_megatron_optimizer`` (fp32 main
  params, fused clip, optional ``DistributedOptimizer`` sharding state over DP ranks). Not run
  in this repo's CPU CI: megatron's optimizers allocate on ``device='cuda'`` unconditionally.

Both expose per-model-parameter access to the fp32 main value and the Adam state, in full
(unsharded over DP) form, which is what the checkpoint code converts to HF names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.backends.schedule import build_optimizer, lr_lambda
from engine.config.schema import OptimConfig


def _not_tp_duplicate(p: torch.nn.Parameter, tp_rank: int) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


class MainGradAdamW:
    """torch AdamW on fp32 main params fed from megatron DDP's ``main_grad``."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimConfig, total_updates: int,
                 model_parallel_group=None, tp_rank: int = 0, expert_params: frozenset = frozenset(),
                 expert_parallel_group=None):
        self.params = params
        self.expert_ids = {id(p) for p in expert_params}
        self.ep_group = expert_parallel_group
        self.mains: list[torch.nn.Parameter] = []
        for p in params:
            main = p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
            self.mains.append(main)
        self._main_of = {id(p): m for p, m in zip(params, self.mains)}
        self.optimizer, self.scheduler = build_optimizer(self.mains, cfg, total_updates)
        self.mp_group = model_parallel_group
        self.tp_rank = tp_rank

    # -- stepping ---------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        sq_experts = torch.zeros_like(sq)
        for p in self.params:
            if id(p) in self.expert_ids:
                sq_experts += p.main_grad.float().pow(2).sum()
            elif _not_tp_duplicate(p, self.tp_rank):
                sq += p.main_grad.float().pow(2).sum()
        if self.mp_group is not None and dist.get_world_size(self.mp_group) > 1:
            dist.all_reduce(sq, group=self.mp_group)
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            dist.all_reduce(sq_experts, group=self.ep_group)
        return (sq + sq_experts).sqrt()

    def step(self, clip: float) -> float:
        """Clip (``clip`` <= 0: off), step, copy fp32 mains back. Returns the pre-clip norm. A
        non-finite norm (nan/inf: the same on every rank, all-reduced) skips the step, as the
        FSDP engine does: a nan gradient would make every weight nan."""
        norm = self.grad_norm()
        if not bool(torch.isfinite(norm)):
            for main in self.mains:
                main.grad = None
            return float(norm)
        coef = 1.0
        if clip > 0:
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        for p, main in zip(self.params, self.mains):
            g = p.main_grad
            main.grad = (g * coef) if clip > 0 else g
        self.optimizer.step()
        for p, main in zip(self.params, self.mains):
            main.grad = None
            if main is not p:
                p.data.copy_(main.data)
        return float(norm)

    # -- per-parameter access (full tensors; this rank's TP shard) ----------------------------
    def main_param(self, p) -> torch.Tensor:
        return self._main_of[id(p)]

    def state(self, p) -> dict:
        return self.optimizer.state.get(self._main_of[id(p)], {})

    def has_state(self, p) -> bool:
        return bool(self.optimizer.state.get(self._main_of[id(p)]))

    def set_state(self, p, values: dict) -> None:
        main = self._main_of[id(p)]
        self.optimizer.state[main] = {k: v.to(main.device) if k != "step" else v.float()
                                      for k, v in values.items()}

    def set_main_param(self, p, value: torch.Tensor) -> None:
        main = self._main_of[id(p)]
        main.data.copy_(value)
        if main is not p:
            p.data.copy_(main.data)

    def group_hparams(self) -> dict:
        g = self.optimizer.param_groups[0]
        return {k: v for k, v in g.items() if k != "params"}

    def set_group_hparams(self, values: dict) -> None:
        for g in self.optimizer.param_groups:
            for k, v in values.items():
                if k in g and k != "params":
                    g[k] = type(g[k])(v) if isinstance(g[k], tuple) else v

    def state_template(self, p) -> dict:
        """AdamW's initial state for ``p`` (what a first step would create, step 0)."""
        main = self._main_of[id(p)]
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(main),
                "exp_avg_sq": torch.zeros_like(main)}

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]


class ChainedLambdaLR:
    """One LR schedule over the torch optimizers inside a megatron ``ChainedOptimizer``; its
    state dict is LambdaLR's (the trainer saves and restores it like the FSDP backend's)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], cfg: OptimConfig, total_updates: int):
        f = lr_lambda(cfg, total_updates)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, f) for o in optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, sd: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(sd)


class MegatronOptimizer:
    """megatron-core's optimizer (CUDA only), behind ``MainGradAdamW``'s interface.

    NOT RUN in this repository's CI (no GPU): written against megatron-core 0.16.1's
    Float16OptimizerWithFloat16Params / FP32Optimizer / DistributedOptimizer internals.
    """

    def __init__(self, ddp_model, params: list[torch.nn.Parameter], cfg: OptimConfig, total_updates: int,
                 dtype: torch.dtype, use_distributed_optimizer: bool):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=0.0, weight_decay=cfg.weight_decay,
                               adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
                               clip_grad=cfg.grad_clip, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                               use_distributed_optimizer=use_distributed_optimizer,
                               # a constant scale of 1 (exact): megatron then checks the main grads for
                               # inf/NaN and skips the step, as MainGradAdamW does; bf16 has no scaler
                               # otherwise, and a NaN gradient was stepped into the weights
                               loss_scale=1.0)
        self.megatron = get_megatron_optimizer(ocfg, [ddp_model])
        self.params = params
        self.optimizer = None
        self.scheduler = ChainedLambdaLR(self.torch_optimizers(), cfg, total_updates)
        self._index()

    def _chain(self) -> list:
        return list(getattr(self.megatron, "chained_optimizers", None) or [self.megatron])

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o.optimizer for o in self._chain()]

    def _index(self) -> None:
        """model param -> (wrapper optimizer, its fp32 main param, or None under
        DistributedOptimizer where each DP rank holds only a slice)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self._where: dict[int, tuple[object, torch.Tensor | None]] = {}
        for opt in self._chain():
            if isinstance(opt, DistributedOptimizer):
                # the params of this optimizer's DDP buffers, even those with no slice on this
                # rank (its collectives need every rank); with expert parallelism the experts
                # are in a second DistributedOptimizer of the chain, over the expert-DP group
                for buf in opt.buffers:
                    for p in buf.param_index_map:
                        self._where.setdefault(id(p), (opt, None))
            elif hasattr(opt, "float16_groups"):          # Float16OptimizerWithFloat16Params
                for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                    for p, main in zip(mg, fg):
                        self._where[id(p)] = (opt, main)
                for g in opt.fp32_from_fp32_groups:
                    for p in g:
                        self._where[id(p)] = (opt, p)
            else:                                          # FP32Optimizer: the param is its own main
                for g in opt.optimizer.param_groups:
                    for p in g["params"]:
                        self._where[id(p)] = (opt, p)

    def step(self, clip: float) -> float:
        """megatron clips (OptimizerConfig.clip_grad) and steps; then its zero_grad drops the
        fp32 main grads it made (the DDP buffers are zeroed again before the next step)."""
        ok, grad_norm, _ = self.megatron.step()
        self.megatron.zero_grad()
        return float(grad_norm) if ok and grad_norm is not None else float("nan")  # skipped: not finite

    # ---- full (DP-unsharded) per-param views; collective under DistributedOptimizer ----------
    _DIST_KEYS = ("exp_avg", "exp_avg_sq")

    @staticmethod
    def _local_slice(opt, p):
        if p not in opt.model_param_group_index_map:
            return None, None
        return opt._get_main_param_and_optimizer_states(p), opt._get_model_param_range_map(p)["param"]

    def _dist_full(self, opt, p, keys) -> dict:
        local, rng = self._local_slice(opt, p)
        out = {}
        for k in keys:
            full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if local is not None and k in local:
                full[rng.start:rng.end] = local[k].detach().float().view(-1)
            dist.all_reduce(full, group=opt.data_parallel_group)
            out[k] = full.view(p.shape)
        return out

    @staticmethod
    def _step_of(opt) -> torch.Tensor:
        for st in opt.optimizer.state.values():
            if "step" in st:
                return torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu().clone()
        return torch.tensor(float(opt.optimizer.param_groups[0].get("step", 0)))

    def main_param(self, p) -> torch.Tensor:
        opt, main = self._where[id(p)]
        if main is not None:
            return main
        return self._dist_full(opt, p, ("param",))["param"]

    def has_state(self, p) -> bool:
        """Collective-free: does the optimizer hold Adam state for ``p``'s (slice of) values."""
        opt, main = self._where[id(p)]
        return bool(opt.optimizer.state.get(main)) if main is not None else self._holds_state(opt)

    @staticmethod
    def _holds_state(opt) -> bool:
        """Whether a DistributedOptimizer's Adam holds moments: its state is a defaultdict, which
        reading a slice's state fills with empty entries, so a non-empty state proves nothing."""
        return any(len(st) for st in opt.optimizer.state.values())

    def state(self, p) -> dict:
        opt, main = self._where[id(p)]
        if main is not None:
            st = dict(opt.optimizer.state.get(main, {}))
            if st and "step" not in st:                   # TE FusedAdam keeps step per group
                st["step"] = self._step_of(opt)
            return st
        holds, step = self._agreed_state(opt, p.device)
        if not holds:
            return {}
        st = self._dist_full(opt, p, self._DIST_KEYS)
        st["step"] = step
        return st

    def _agreed_state(self, opt, device) -> tuple[bool, torch.Tensor]:
        """Whether any data-parallel rank of ``opt`` holds Adam state, and its step count, agreed by
        all of them: a rank whose slice of the buffers holds no parameter has neither, and deciding
        alone it would skip the all-reduces the other ranks then wait in (a hang), or save step 0."""
        flags = torch.tensor([float(self._holds_state(opt)), float(self._step_of(opt))], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=opt.data_parallel_group)  # on the params' device, as _dist_full
        return bool(flags[0] > 0), flags[1].cpu().clone()

    def set_state(self, p, values: dict) -> None:
        opt, main = self._where[id(p)]
        if main is not None:
            st = opt.optimizer.state.setdefault(main, {})
            for k, v in values.items():
                if k == "step":
                    self._set_step(opt, main, v)
                else:
                    st[k] = v.to(main.device)
            return
        local, rng = self._local_slice(opt, p)
        if local is None:
            return
        shard = local["param"]  # the fp32 main slice, the key of its Adam state
        st = opt.optimizer.state[shard]
        for k, v in values.items():
            if k == "step":
                self._set_step(opt, shard, v)
                continue
            piece = v.reshape(-1)[rng.start:rng.end].to(shard.device, torch.float32).view_as(shard)
            if isinstance(st.get(k), torch.Tensor):
                st[k].copy_(piece)
            else:  # a fresh process: Adam creates its state at the first step, so there is none yet
                st[k] = piece.clone()

    @staticmethod
    def _set_step(opt, main: torch.Tensor, value) -> None:
        """Adam's step count, where the optimizer keeps it: torch's Adam/AdamW per parameter (a
        0-dim float tensor on the host), Transformer-Engine's and Apex's FusedAdam per param
        group (``group["step"]``, an int)."""
        inner = opt.optimizer
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            inner.state[main]["step"] = torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(()).clone()
        else:
            for g in inner.param_groups:
                g["step"] = int(round(float(value)))

    def set_main_param(self, p, value: torch.Tensor) -> None:
        opt, main = self._where[id(p)]
        if main is not None:
            main.data.copy_(value)
        else:
            local, rng = self._local_slice(opt, p)
            if local is not None:
                local["param"].data.copy_(value.reshape(-1)[rng.start:rng.end].view_as(local["param"]))
        p.data.copy_(value)

    def state_template(self, p) -> dict:
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros(p.shape, dtype=torch.float32),
                "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32)}

    def group_hparams(self) -> dict:
        g = self.torch_optimizers()[0].param_groups[0]
        return {k: v for k, v in g.items() if k in ("lr", "initial_lr", "betas", "eps", "weight_decay")}

    def set_group_hparams(self, values: dict) -> None:
        for o in self.torch_optimizers():
            for g in o.param_groups:
                for k in ("lr", "initial_lr"):
                    if k in values and k in g:
                        g[k] = values[k]

    def ensure_state(self) -> None:
        """Materialise Adam state before a checkpoint load (megatron's dummy-step helper)."""
        for opt in self._chain():
            init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            if init is not None:
                init()
