"""The PPO critic on the FSDP2 engine: a value head on a copy of the policy's network (or on
``critic.model_path``), sharded like the policy, with its own AdamW optimizer and LR. Its
update and value pass are the shared ones (engine/backends/critic.py).
"""

from __future__ import annotations

import torch

from engine.algorithms.value_loss import values_per_token
from engine.backends.critic import Critic
from engine.backends.fsdp.rank0_weights import built_on_every_rank, full_state, reads_weights, receive_weights
from engine.backends.fsdp.units import decoder_blocks, use_cpu_matmul
from engine.batch import SequenceBatch


class ValueModel(torch.nn.Module):
    """A causal LM's backbone plus a scalar head: [B, T] ids -> [B, T] values per position."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # in the backbone's dtype: FSDP2's mixed precision gathers the head's weight in model.dtype too
        # (an fp32 input against a bf16 weight is an error); the values themselves in fp32
        v = self.value_head(h).float().squeeze(-1)
        return values_per_token(v)


class FSDPCritic(Critic):
    """Built on every rank next to the FSDPEngine it reads micro-batches and the mesh from."""

    def __init__(self, cfg, engine):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from engine.model.build import build_hf_model

        from engine.model.source import critic_model_dir

        super().__init__(cfg, engine)
        c = cfg.critic

        reads = reads_weights(engine.units, engine.world_size)  # else meta modules, filled from rank 0 (as the policy)

        def build():
            return build_hf_model(cfg.model, critic_model_dir(c.model_path, engine.model_path), engine.vocab_size,
                                  cfg.trainer.seed, engine.pad_token_id, engine.eos_token_id,
                                  load_dtype=torch.float32, on_meta=not reads).float()

        shared = engine.units != "none" and engine.world_size > 1
        lm = built_on_every_rank(build) if shared else build()
        with torch.device("meta" if not reads else "cpu"):
            model = ValueModel(lm.base_model, lm.config.hidden_size)  # the backbone, whatever the architecture names it
        del lm
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.model.dtype), reduce_dtype=torch.float32)
        if engine.units == "none":
            model.to(engine.device)
        else:  # the policy's layout (engine/backends/fsdp/units.py fsdp_units); fully_shard moves each unit to the device
            whole = full_state(model) if reads and shared else ({}, {})
            for layer in decoder_blocks(model.backbone) if engine.units == "layer" else []:
                fully_shard(layer, mesh=engine.mesh, mp_policy=mp, reshard_after_forward=cfg.engine.reshard_after_forward)
            fully_shard(model, mesh=engine.mesh, mp_policy=mp, reshard_after_forward=cfg.engine.reshard_after_forward)
            if shared:
                receive_weights(model, engine.device, whole)
            del whole
        if cfg.engine.fused_kernels:  # the same kernels as the policy's (engine/model/fused_kernels.py)
            from engine.model.fused_kernels import use_fused_kernels

            use_fused_kernels(model)
        use_cpu_matmul(cfg.engine, engine.device, model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=tuple(cfg.optim.betas),
                                           eps=cfg.optim.eps, weight_decay=c.weight_decay, foreach=False)
        self.step_optimizer = self.optimizer

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _forward(self, batch: SequenceBatch) -> torch.Tensor:
        return self.model(batch.input_ids.to(self.engine.device), batch.attention_mask.to(self.engine.device))

    # ---- checkpoints (inside the engine's DCP state, under "critic") ----------------------
    def checkpoint_state(self, for_save: bool = False) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        from engine.checkpoint.fresh_optimizer import keep_fresh

        with keep_fresh(self.optimizer, for_save) as fix:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                                options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": model_sd, "optim": fix(optim_sd)}

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
