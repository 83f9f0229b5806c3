"""The PPO critic on the Megatron engine: the policy's network as a megatron-core ``GPTModel``
(same tensor/data-parallel layout, built from the same weights, or from ``critic.model_path``)
whose output layer is replaced by a scalar value head, wrapped in its own megatron DDP, with its
own optimizer (``critic.lr`` constant, ``critic.weight_decay``, ``critic.grad_clip``).

What is engine-independent (the value alignment V(tokens < t) and the clipped value loss) is
engine/algorithms/value_loss.py, shared with the FSDP2 critic (engine/backends/fsdp/critic.py); the update loop is
engine/backends/critic.py.

Value head. ``GPTModel`` runs embedding -> decoder -> final norm -> ``output_layer``; here
``output_layer`` is a ``ValueHead`` (hidden -> 1, replicated on every TP rank, zero-initialised),
so the forward returns [B, T, 1] and nothing vocab-sized is built. The hidden state entering it
is the same on every TP rank (sequence parallel: gathered first), so every TP rank computes the
same values and the same head gradient; the grad norm counts the head once (optimizer.py).

Checkpoint. Entries carry the FSDP2 critic's names (``critic.model.backbone.layers.0....``,
``critic.model.value_head.weight``, ``critic.optim.state.<name>.exp_avg``...), gathered over TP
and sliced back on load (sharded_state.py), so a critic resumes at any TP/DP layout and moves
between the two engines like the policy does.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.errors import ConfigError

from engine.algorithms.value_loss import values_per_token
from engine.backends.critic import Critic
from engine.batch import SequenceBatch

HEAD = "output_layer"   # the GPTModel attribute the value head replaces


class ValueHead(torch.nn.Linear):
    """hidden [s, b, h] -> values [s, b, 1] in float32, called the way GPTModel calls its output
    layer (``weight=``, ``runtime_gather_output=`` are for the LM head and ignored here)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, tp_group):
        super().__init__(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # each TP rank holds a slice of the sequence: gather it
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # what follows is computed whole on every TP rank (replicated head, same loss), so each
            # rank's gradient of the gathered states is already the full one: backward takes this
            # rank's slice of it. The default (True, for a tensor-parallel layer after the gather,
            # whose ranks hold partial gradients) reduce-scatters, a sum of tp_size equal copies
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return super().forward(hidden.float()), None


def critic_mappings(arch):
    """The policy's parameter mappings without the LM head, under the FSDP2 critic's names
    (``model.X`` -> ``backbone.X``), plus the value head."""
    from engine.backends.megatron.hf_convert import ParamMapping, param_mappings

    out = []
    for m in param_mappings(arch):
        if m.megatron_name == f"{HEAD}.weight":
            continue
        out.append(ParamMapping(m.megatron_name, tuple("backbone." + n.removeprefix("model.") for n in m.hf_names),
                                m.kind))
    out += [ParamMapping(f"{HEAD}.weight", ("value_head.weight",), "replicated"),
            ParamMapping(f"{HEAD}.bias", ("value_head.bias",), "replicated")]
    return out


def critic_optim_config(cfg):
    """The policy's AdamW settings with the critic's LR (constant, no warmup), weight decay and clip."""
    c = cfg.critic
    return replace(cfg.optim, lr=c.lr, weight_decay=c.weight_decay, grad_clip=c.grad_clip, warmup_steps=0,
                   schedule="constant")


class MegatronCritic(Critic):
    """Built on every rank next to the MegatronEngine whose layout, micro-batching and forward
    it reuses (after ``engine.build()``); its update is the shared one (engine/backends/critic.py:
    megatron's DDP reduction and ``MainGradAdamW``/megatron's optimizer through the engine's hooks,
    with a constant LR: no schedule to step)."""

    def __init__(self, cfg, engine):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from engine.backends.megatron.model import (arch_from_hf_config, build_gpt_model, check_parallel_layout,
                                                    fusion_choices, transformer_config)
        from engine.backends.megatron.fp8_shapes import check_fp8_shapes
        from engine.backends.megatron.sharded_state import ShardedState
        from engine.model.build import build_hf_model
        from engine.model.source import critic_model_dir

        super().__init__(cfg, engine)
        e = engine
        on_gpu = e.device.type == "cuda"
        hf = build_hf_model(cfg.model, critic_model_dir(cfg.critic.model_path, e.model_path), e.vocab_size,
                            cfg.trainer.seed, e.pad_token_id, e.eos_token_id)
        self.arch = arch_from_hf_config(hf.config, fused_norms=e.use_te)
        check_parallel_layout(self.arch, e.tp_size)
        if cfg.engine.fp8:
            check_fp8_shapes(self.arch, e.tp_size)
        if self.arch.is_moe:
            raise ConfigError("algorithm=ppo on engine=megatron builds a dense critic; this critic model is a "
                              "mixture of experts. Set critic.model_path to a dense model (e.g. a Llama/Qwen2 of "
                              "the same tokenizer), or use engine=fsdp.", title="unsupported model")
        self.tcfg = transformer_config(self.arch, dtype=e.dtype, tp=e.tp_size,
                                       sequence_parallel=bool(e.tcfg.sequence_parallel), on_gpu=on_gpu,
                                       fp8=cfg.engine.fp8, recompute=cfg.engine.gradient_checkpointing,
                                       fusions=fusion_choices(on_gpu, e.use_te)[0])  # the policy's notes said why
        self.mappings = critic_mappings(self.arch)
        # the HF weights under the critic's checkpoint names; the value head starts at zero
        full = {"backbone." + k.removeprefix("model."): v.detach() for k, v in hf.named_parameters()
                if k.startswith("model.")}
        del hf
        gpt = build_gpt_model(self.arch, self.tcfg, e.use_te)
        with torch.random.fork_rng(devices=[]):  # the head is zeroed; its default init must not move the RNG
            setattr(gpt, HEAD, ValueHead(self.arch.hidden_size, bool(self.tcfg.sequence_parallel), e.tp_group))
        params = dict(gpt.named_parameters())
        names = {m.megatron_name for m in self.mappings}
        if set(params) != names:
            raise RuntimeError(f"megatron critic parameter names differ from its mapping: "
                               f"{sorted(set(params) ^ names)}")
        from engine.backends.megatron.hf_convert import shard_from_hf

        with torch.no_grad():
            for m in self.mappings:
                if not m.megatron_name.startswith(f"{HEAD}."):
                    params[m.megatron_name].copy_(shard_from_hf(m, full, self.arch, e.tp_rank, e.tp_size))
        del full
        gpt.to(e.device)
        use_dist_opt = on_gpu and bool(getattr(cfg.engine, "use_distributed_optimizer", False))
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=use_dist_opt)
        self.model = DistributedDataParallel(self.tcfg, ddp_cfg, gpt)
        self._params = dict(self.model.module.named_parameters())
        plist = [self._params[m.megatron_name] for m in self.mappings]
        ocfg = critic_optim_config(cfg)
        if on_gpu:
            from engine.backends.megatron.optimizer import MegatronOptimizer

            self.opt = MegatronOptimizer(self.model, plist, ocfg, e.total_updates, e.dtype, use_dist_opt)
        else:
            from engine.backends.megatron.optimizer import MainGradAdamW

            self.opt = MainGradAdamW(plist, ocfg, e.total_updates, ps.get_model_parallel_group(), e.tp_rank)
        self.step_optimizer = self.opt
        self.sharded = ShardedState(self.mappings, self._params, self.arch, e.tp_rank, e.tp_size, e.tp_group,
                                    e.device)

    @property
    def optimizer(self):
        """What holds the optimizer state (memory tracking, offload), as MegatronEngine.optimizer."""
        return self.opt.megatron if hasattr(self.opt, "megatron") else self.opt.optimizer

    def optimizer_objects(self) -> list:
        return [self.opt.megatron] if hasattr(self.opt, "megatron") else self.opt.torch_optimizers()

    def param_count(self) -> int:
        return self.sharded.param_count()

    def _forward(self, batch: SequenceBatch) -> torch.Tensor:
        out = self.engine._forward_logits(self.model, batch)   # [B, T, 1]: the value head's output
        return values_per_token(out.squeeze(-1))

    # ---- checkpoints (inside the engine's DCP state, under "critic") ----------------------
    def checkpoint_state(self, for_save: bool = False) -> dict:
        # a parameter without state yet is saved as the fresh state (zeros, step 0): the manifest
        # records no critic coverage, so every critic entry must be in the checkpoint
        return self.sharded.checkpoint_state(self.opt)

    def load_checkpoint_state(self, state: dict) -> None:
        self.sharded.load_checkpoint_state(self.opt, state)
