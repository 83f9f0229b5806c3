"""The PPO critic on the FSDP2 engine: a value head on a copy of the policy's network (or on
``critic.model_path``), sharded like the policy, with its own AdamW optimizer and LR.

The value alignment (``values[:, t]`` is V(tokens < t)) and the clipped value loss are
engine-independent: engine/algorithms/value_loss.py. The value head starts at zero, so the
first advantages are plain (whitened) returns. The Megatron engine's critic is
engine/backends/megatron/critic.py.
"""

from __future__ import annotations

import torch

from engine.algorithms.value_loss import value_loss, values_per_token
from engine.backends.base import global_counts
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
        v = self.value_head(h.float()).squeeze(-1)
        return values_per_token(v)


class FSDPCritic:
    """Built on every rank next to the FSDPEngine it reads micro-batches and the mesh from."""

    def __init__(self, cfg, engine):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from engine.backends.fsdp import decoder_blocks, use_cpu_matmul
        from engine.model.build import build_hf_model

        self.cfg, self.engine = cfg, engine
        c = cfg.critic
        from engine.model.source import critic_model_dir

        lm = build_hf_model(cfg.model, critic_model_dir(c.model_path, engine.model_path), engine.vocab_size, cfg.trainer.seed, engine.pad_token_id,
                            engine.eos_token_id).float()
        model = ValueModel(lm.base_model, lm.config.hidden_size)  # the backbone, whatever the architecture names it
        del lm
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.model.dtype), reduce_dtype=torch.float32)
        model.to(engine.device)
        if engine.units != "none":  # the policy's layout (engine/backends/fsdp.py fsdp_units)
            for layer in decoder_blocks(model.backbone) if engine.units == "layer" else []:
                fully_shard(layer, mesh=engine.mesh, mp_policy=mp, reshard_after_forward=cfg.engine.reshard_after_forward)
            fully_shard(model, mesh=engine.mesh, mp_policy=mp, reshard_after_forward=cfg.engine.reshard_after_forward)
        if cfg.engine.fused_kernels:  # the same kernels as the policy's (engine/model/fused_kernels.py)
            from engine.model.fused_kernels import use_fused_kernels

            use_fused_kernels(model)
        use_cpu_matmul(cfg.engine, engine.device, model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=tuple(cfg.optim.betas),
                                           eps=cfg.optim.eps, weight_decay=c.weight_decay, foreach=False)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _forward(self, mb: SequenceBatch) -> torch.Tensor:
        return self.model(mb.input_ids.to(self.engine.device), mb.attention_mask.to(self.engine.device))

    @torch.no_grad()
    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        self.model.eval()
        B, T = batch.input_ids.shape
        out = torch.zeros(B, T)
        for mb in self.engine._micro_batches(batch, observe=False):
            v = self._forward(mb.batch)
            k, real = mb.num_rows, mb.indices >= 0
            t = min(T, v.shape[1])
            out[mb.indices[real], :t] = v[:k][real, :t].float().cpu()
        return out * batch.response_mask

    def train_step(self, batch: SequenceBatch) -> dict:
        """One optimizer step of the critic on this rank's share of a mini-batch (needs
        ``batch.values`` and ``batch.returns``). Returns partial sums of its metrics."""
        from engine.backends.fsdp import set_gradient_sync

        self.model.train()
        n_tokens, _ = global_counts(batch, None, self.engine.world_size)
        mbs = self.engine._micro_batches(batch, observe=False)
        sums = {"value_loss": 0.0, "value_clip_frac": 0.0}
        for i, mb in enumerate(mbs):
            set_gradient_sync(self.model, i == len(mbs) - 1)
            b = mb.batch
            v = self._forward(b)
            dev = self.engine.device
            loss, clipped = value_loss(v, b.values.to(dev), b.returns.to(dev), b.response_mask.to(dev),
                                       self.cfg.critic.cliprange_value, n_tokens)
            (loss * self.engine.world_size).backward()  # undo the data-parallel mean of gradients
            sums["value_loss"] += loss.item()
            sums["value_clip_frac"] += clipped.item()
        clip = self.cfg.critic.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        finite = bool(torch.isfinite(norm))
        if finite:  # as the policy's (engine/backends/fsdp.py): a nan/inf gradient is not applied
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"metrics": sums, "replicated": {"value_grad_norm": float(norm),
                                                "value_nonfinite_updates": 0.0 if finite else 1.0}}

    # ---- checkpoints (inside the engine's DCP state, under "critic") ----------------------
    def checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": model_sd, "optim": optim_sd}

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
