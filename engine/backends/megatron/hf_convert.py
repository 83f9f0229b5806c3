"""Hugging Face (Llama/Qwen2) weights <-> megatron-core GPTModel weights, per TP rank.

One ``ParamMapping`` per megatron parameter says which HF tensors it is made of and how it
is split over tensor-parallel ranks. The same mapping converts anything shaped like the
parameters: weights, and AdamW's ``exp_avg``/``exp_avg_sq`` for checkpoints.

Layouts (H hidden, hd head dim, G key/value groups, R = queries per group, I MLP size):

* ``qkv``  linear_qkv.{weight,bias}: megatron interleaves per query group,
  ``[q_g0 (R*hd rows), k_g0 (hd), v_g0 (hd), q_g1, ...]``; column-parallel, so TP rank r
  holds groups ``r*G/tp .. (r+1)*G/tp - 1`` (a contiguous chunk of that fused tensor).
* ``fc1``  linear_fc1.weight for SwiGLU: each TP rank holds ``[gate_r; up_r]`` where
  gate_r/up_r are its row chunks of HF gate_proj/up_proj (megatron's ``glu`` chunks the
  local output in two: first half through SiLU, times the second half).
* ``row``  linear_proj / linear_fc2: row-parallel, split along the input dimension.
* ``vocab`` word embeddings / output layer: rows padded to the padded vocab with zeros,
  split along the vocab dimension.
* ``replicated`` RMSNorm weights, and an MoE layer's router (``mlp.router.weight`` = HF
  ``mlp.gate.weight``, [E, H]): every TP rank holds the whole tensor.
* ``expert_fc1`` / ``expert_fc2`` (Mixtral): transformers 5.x stores a layer's experts fused,
  ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first, as megatron's ``[gate; up]``) and
  ``mlp.experts.down_proj`` [E, H, I]. Megatron holds one ``local_experts.{j}.linear_fc1`` /
  ``linear_fc2`` per expert of this expert-parallel rank; local expert j of EP rank r is global
  expert ``r * E/ep + j`` (``ParamMapping.expert``), one slice of the HF tensor. Several mappings
  share one HF name; ``stack_experts`` puts the slices back together (after an all-gather over EP).

Export concatenates the TP shards back and drops the vocab padding, so HF -> megatron ->
HF is bit-exact (only slicing and concatenation, no arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.backends.megatron.model import Arch, padded_vocab_size


@dataclass(frozen=True)
class ParamMapping:
    megatron_name: str
    hf_names: tuple[str, ...]
    kind: str  # "qkv" | "fc1" | "row" | "vocab" | "replicated" | "expert_fc1" | "expert_fc2"
    expert: int = -1  # expert kinds: the global expert index (the slice of the HF tensor)

    @property
    def is_expert(self) -> bool:
        return self.kind.startswith("expert_")


def _mlp_mappings(arch: Arch, m: str, h: str, ep_rank: int, ep_size: int) -> list[ParamMapping]:
    if not arch.is_moe:
        return [ParamMapping(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "fc1"),
                ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row")]
    local = arch.num_experts // ep_size
    out = [ParamMapping(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated")]
    for j in range(local):
        e, x = ep_rank * local + j, f"{m}mlp.experts.local_experts.{j}."
        out += [ParamMapping(x + "linear_fc1.weight", (h + "mlp.experts.gate_up_proj",), "expert_fc1", e),
                ParamMapping(x + "linear_fc2.weight", (h + "mlp.experts.down_proj",), "expert_fc2", e)]
    return out


def param_mappings(arch: Arch, pre_process: bool = True, post_process: bool = True,
                   layer_offset: int = 0, num_local_layers: int | None = None, ep_rank: int = 0,
                   ep_size: int = 1) -> list[ParamMapping]:
    """Every trainable megatron parameter of one pipeline stage (and expert-parallel rank), in a
    fixed order."""
    n = arch.num_layers if num_local_layers is None else num_local_layers
    out: list[ParamMapping] = []
    if pre_process:
        out.append(ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for i in range(n):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i + layer_offset}."
        attn_norm = "self_attention.linear_qkv.layer_norm_weight" if arch.fused_norms else "input_layernorm.weight"
        # TE fuses the MLP's norm into linear_fc1 for a dense MLP only: a MoE layer's router reads the
        # normed input, so its norm stays a module of its own (megatron's TE spec, num_experts set)
        mlp_norm = ("mlp.linear_fc1.layer_norm_weight" if arch.fused_norms and not arch.is_moe
                    else "pre_mlp_layernorm.weight")
        qkv = (h + "self_attn.q_proj.", h + "self_attn.k_proj.", h + "self_attn.v_proj.")
        out += [
            ParamMapping(m + attn_norm, (h + "input_layernorm.weight",), "replicated"),
            ParamMapping(m + "self_attention.linear_qkv.weight", tuple(p + "weight" for p in qkv), "qkv"),
        ]
        if arch.qkv_bias:
            out.append(ParamMapping(m + "self_attention.linear_qkv.bias", tuple(p + "bias" for p in qkv), "qkv"))
        out += [
            ParamMapping(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"),
            ParamMapping(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"),
        ]
        out += _mlp_mappings(arch, m, h, ep_rank, ep_size)
    if post_process:
        out.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if not arch.tie_word_embeddings:
            out.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def hf_param_names(arch: Arch) -> list[str]:
    """The HF trainable parameter names this architecture has (tied lm_head excluded)."""
    return list(dict.fromkeys(n for m in param_mappings(arch) for n in m.hf_names))


# ---- HF -> megatron -------------------------------------------------------------------------
def _fuse_qkv(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, r, hd = arch.num_kv_heads, arch.queries_per_group, arch.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(g, r * hd, *tail), k.reshape(g, hd, *tail), v.reshape(g, hd, *tail))
    return torch.cat(parts, dim=1).reshape(g * (r + 2) * hd, *tail)


def shard_from_hf(m: ParamMapping, hf: dict[str, torch.Tensor], arch: Arch, tp_rank: int,
                  tp_size: int) -> torch.Tensor:
    """This TP rank's piece of megatron parameter ``m`` built from full HF tensors."""
    ts = [hf[n] for n in m.hf_names]
    if m.is_expert:  # experts are not split over TP here (MoE runs at TP=1)
        return ts[0][m.expert].clone()
    if m.kind == "replicated":
        return ts[0].clone()
    if m.kind == "vocab":
        full = ts[0]
        pad = padded_vocab_size(arch.vocab_size, tp_size) - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])], 0)
        return full.chunk(tp_size, 0)[tp_rank].clone()
    if m.kind == "row":
        return ts[0].chunk(tp_size, 1)[tp_rank].clone()
    if m.kind == "qkv":
        return _fuse_qkv(arch, *ts).chunk(tp_size, 0)[tp_rank].clone()
    if m.kind == "fc1":
        gate, up = ts
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
    raise ValueError(f"unknown mapping kind {m.kind}")


def hf_to_megatron(hf: dict[str, torch.Tensor], arch: Arch, tp_rank: int, tp_size: int,
                   **stage) -> dict[str, torch.Tensor]:
    """All of this rank's megatron tensors (names as in ``GPTModel.named_parameters()``)."""
    return {m.megatron_name: shard_from_hf(m, hf, arch, tp_rank, tp_size) for m in param_mappings(arch, **stage)}


# ---- megatron -> HF -------------------------------------------------------------------------
def hf_from_shards(m: ParamMapping, shards: Sequence[torch.Tensor], arch: Arch) -> dict[str, torch.Tensor]:
    """Full HF tensors of mapping ``m`` from its TP shards (in TP-rank order); an expert mapping
    gives its expert's slice (``stack_experts`` assembles them)."""
    if m.is_expert:
        return {m.hf_names[0]: shards[0].clone()}
    if m.kind == "replicated":
        return {m.hf_names[0]: shards[0].clone()}
    if m.kind == "vocab":
        return {m.hf_names[0]: torch.cat(list(shards), 0)[: arch.vocab_size].clone()}
    if m.kind == "row":
        return {m.hf_names[0]: torch.cat(list(shards), 1)}
    if m.kind == "qkv":
        full = torch.cat(list(shards), 0)
        g, r, hd = arch.num_kv_heads, arch.queries_per_group, arch.head_dim
        tail = full.shape[1:]
        q, k, v = full.reshape(g, (r + 2) * hd, *tail).split([r * hd, hd, hd], dim=1)
        return {name: t.reshape(-1, *tail).clone() for name, t in zip(m.hf_names, (q, k, v))}
    if m.kind == "fc1":
        halves = [s.chunk(2, 0) for s in shards]
        gate = torch.cat([h[0] for h in halves], 0)
        up = torch.cat([h[1] for h in halves], 0)
        return {m.hf_names[0]: gate, m.hf_names[1]: up}
    raise ValueError(f"unknown mapping kind {m.kind}")


def stack_experts(slices: dict[str, list[tuple[int, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """{HF name: [(global expert, slice), ...]} -> {HF name: [E, ...]}, every expert present once."""
    out = {}
    for name, parts in slices.items():
        order = sorted(parts, key=lambda x: x[0])
        if [e for e, _ in order] != list(range(len(order))):
            raise ValueError(f"{name}: experts {[e for e, _ in order]} are not 0..E-1 exactly once")
        out[name] = torch.stack([t for _, t in order])
    return out


def megatron_to_hf(shards: Sequence[dict[str, torch.Tensor]], arch: Arch, **stage) -> dict[str, torch.Tensor]:
    """Full HF state dict from every TP rank's megatron tensors (list index = TP rank; at EP=1)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list] = {}
    for m in param_mappings(arch, **stage):
        if m.is_expert:
            experts.setdefault(m.hf_names[0], []).append((m.expert, shards[0][m.megatron_name].clone()))
            continue
        out.update(hf_from_shards(m, [s[m.megatron_name] for s in shards], arch))
    out.update(stack_experts(experts))
    return out
