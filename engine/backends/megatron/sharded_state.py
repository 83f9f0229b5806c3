"""A megatron model's parameters as checkpoint entries under Hugging Face names, for any
model this backend trains (the policy in engine.py, the PPO critic in critic.py).

``ShardedState`` pairs this TP rank's megatron parameters with their ``ParamMapping``s
(hf_convert.py) and converts in both directions:

* ``checkpoint_state(opt)``: {"model": {hf name: full fp32 main weight}, "optim": AdamW state
  flattened like ``torch.distributed.checkpoint.state_dict``'s ``flatten_optimizer_state_dict``
  (``state.<hf name>.exp_avg``, ``param_groups.<hf name>.lr`` ...)}. Collective over the TP
  group (shards are gathered); every rank offers full tensors and DCP writes each key once.
* ``load_checkpoint_state(opt, state)``: slices this rank's TP shard out of the full tensors,
  so any TP/DP layout resumes any other (and an FSDP checkpoint with the same names).

Experts (MoE): each expert-parallel rank holds E/ep experts of every layer; their HF tensors
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) are assembled by an
all-gather over the expert-parallel group, so a checkpoint holds every expert under its HF name
whatever EP wrote it, and any EP size loads it (each rank slices its own experts back out).

``opt`` is a ``MainGradAdamW`` or ``MegatronOptimizer`` (optimizer.py): both give per-parameter
access to the fp32 main value and the Adam state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.backends.megatron.hf_convert import ParamMapping, hf_from_shards, shard_from_hf, stack_experts
from engine.backends.megatron.model import Arch


@dataclass
class ShardedState:
    mappings: list[ParamMapping]
    params: dict[str, torch.nn.Parameter]   # megatron name -> this rank's parameter
    arch: Arch
    tp_rank: int
    tp_size: int
    tp_group: object
    device: torch.device
    ep_size: int = 1
    ep_group: object = None

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.tp_size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return parts

    def _gather_experts(self, local: dict[str, list[tuple[int, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        """{HF name: this rank's [(global expert, slice)]} -> {HF name: [E, ...]} over the EP group
        (local expert j of EP rank r is expert r * E/ep + j: the same j order on every rank)."""
        if self.ep_size > 1:
            gathered = {}
            for name, parts in local.items():
                mine = torch.stack([t for _, t in parts]).contiguous()
                every = [torch.empty_like(mine) for _ in range(self.ep_size)]
                dist.all_gather(every, mine, group=self.ep_group)
                n = len(parts)
                gathered[name] = [(r * n + j, x[j]) for r, x in enumerate(every) for j in range(n)]
            local = gathered
        return stack_experts(local)

    def gather_hf(self, local_of) -> dict[str, torch.Tensor]:
        """Full HF-named tensors from ``local_of(param)`` (this rank's TP shard), on every rank."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, list] = {}
        for m in self.mappings:
            t = local_of(self.params[m.megatron_name]).detach()
            if m.is_expert:
                experts.setdefault(m.hf_names[0], []).append((m.expert, t))
                continue
            out.update({k: v.cpu() for k, v in hf_from_shards(m, self._gather(t), self.arch).items()})
        out.update({k: v.cpu() for k, v in self._gather_experts(experts).items()})
        return out

    def checkpoint_state(self, opt, for_save: bool = False) -> dict:
        """``for_save``: a parameter the optimizer holds no state for yet (no update has run) gets
        none in the checkpoint either, as optimizer_coverage says (resume backfills it); as a load
        template, the fresh state's shape (zeros)."""
        model = self.gather_hf(lambda p: opt.main_param(p).float())
        optim: dict = {}
        experts: dict[str, list] = {}
        hp = opt.group_hparams()
        for m in self.mappings:
            p = self.params[m.megatron_name]
            st = opt.state(p) or ({} if for_save else opt.state_template(p))  # the same on every rank
            step = torch.as_tensor(st.get("step", 0), dtype=torch.float32).detach().cpu().reshape(())
            for key, v in st.items():
                if key == "step" or not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                if m.is_expert:
                    experts.setdefault(f"state.{m.hf_names[0]}.{key}", []).append(
                        (m.expert, v.detach().float().to(self.device)))
                    continue
                parts = self._gather(v.detach().float().to(self.device))
                for name, full in hf_from_shards(m, parts, self.arch).items():
                    optim[f"state.{name}.{key}"] = full.cpu()
            for name in m.hf_names:
                if st:
                    optim[f"state.{name}.step"] = step.clone()
                for k, v in hp.items():
                    optim[f"param_groups.{name}.{k}"] = v
        optim.update({k: v.cpu() for k, v in self._gather_experts(experts).items()})
        return {"model": model, "optim": optim}

    def load_checkpoint_state(self, opt, state: dict) -> None:
        """Optimizer entries a checkpoint lacks (``optimizer.param_state`` false, dropped by the
        loader) keep the live optimizer's state."""
        model, optim = state.get("model", {}), state.get("optim", {})
        for m in self.mappings:
            p = self.params[m.megatron_name]
            if all(n in model for n in m.hf_names):
                full = {n: model[n] for n in m.hf_names}
                local = shard_from_hf(m, full, self.arch, self.tp_rank, self.tp_size)
                with torch.no_grad():
                    opt.set_main_param(p, local.to(self.device, torch.float32))
            first = m.hf_names[0]
            keys = sorted({k[len(f"state.{first}."):] for k in optim if k.startswith(f"state.{first}.")})
            tensor_keys = [k for k in keys if k != "step"]
            if "step" not in keys or not all(f"state.{n}.{k}" in optim for n in m.hf_names for k in keys):
                continue
            values = {k: shard_from_hf(m, {n: optim[f"state.{n}.{k}"] for n in m.hf_names}, self.arch,
                                       self.tp_rank, self.tp_size).float() for k in tensor_keys}
            values["step"] = torch.as_tensor(optim[f"state.{first}.step"], dtype=torch.float32).reshape(()).clone()
            opt.set_state(p, values)
        groups = {k.split(".")[-1]: v for k, v in optim.items() if k.startswith("param_groups.")}
        if groups:
            opt.set_group_hparams(groups)

    def optimizer_coverage(self, opt) -> dict[str, bool]:
        """Collective-free: HF name -> does AdamW hold state for it (an experts tensor: for every
        expert of this rank)."""
        out: dict[str, bool] = {}
        for m in self.mappings:
            has = opt.has_state(self.params[m.megatron_name])
            for name in m.hf_names:
                out[name] = out.get(name, True) and has
        return out

    def param_shapes(self) -> dict[str, dict]:
        """Full (unsharded) shapes under HF names, as the manifest records them."""
        out = {}
        for m in self.mappings:
            p = self.params[m.megatron_name]
            for name in m.hf_names:
                out[name] = {"shape": list(hf_shape(name, m.kind, p, self.arch, self.tp_size)), "dtype": "float32"}
        return out  # an experts tensor is listed once (every local expert writes the same full shape)

    def param_count(self) -> int:
        return sum(int(torch.Size(s["shape"]).numel()) for s in self.param_shapes().values())


def hf_shape(name: str, kind: str, p: torch.Tensor, arch: Arch, tp: int) -> tuple[int, ...]:
    """Full HF shape of ``name`` from its megatron shard ``p``."""
    a = arch
    if kind.startswith("expert_"):
        return (a.num_experts,) + tuple(p.shape)
    if kind == "replicated":
        return tuple(p.shape)
    if kind == "vocab":
        return (a.vocab_size, a.hidden_size)
    if kind == "row":
        return (p.shape[0], p.shape[1] * tp)
    if kind == "fc1":
        return (a.intermediate_size, a.hidden_size)
    if kind == "qkv":
        rows = a.num_heads * a.head_dim if ".q_proj." in name else a.num_kv_heads * a.head_dim
        return (rows,) + tuple(p.shape[1:])
    raise ValueError(kind)
