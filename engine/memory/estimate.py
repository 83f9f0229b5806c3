"""Estimate per-rank device memory for a run config, without weights and without a GPU.

    est = estimate_memory(run_cfg)                                # the config's model
    est = estimate_memory(run_cfg, model="llama-70b", device_memory_bytes=80 << 30)
    est = estimate_memory(run_cfg, hf_config_path="/models/Qwen2.5-7B")

The architecture is built with transformers on the meta device (no weights allocated), from
the tiny ``model.*`` dims, a local HF directory's ``config.json``, or a built-in Llama-style
config (``BUILTIN_MODELS``: public architecture numbers, nothing downloaded), and every
parameter is attributed to a rank by the backend's layout:

- FSDP2 (ZeRO-3): params, grads and optimizer state sharded over ``trainer.nprocs``; plus
  the all-gathered working set (root unit + two decoder layers in flight) when DP > 1.
- Megatron: layers split over pipeline stages (most-loaded stage reported), matrices and the
  vocabulary split over tensor-parallel ranks (norms replicated), fp32 main grads, optimizer
  state sharded over data-parallel ranks with the distributed optimizer.

Bytes per category (``engine.memory.report.CATEGORIES``):

- params: FSDP2 4 B (fp32 masters whatever ``model.dtype``: its mixed-precision policy computes
  in a low-precision copy of each gathered unit); Megatron the param dtype (bf16 = 2 B, fp32 =
  4 B); x params on the rank (+ frozen reference policy when ``algorithm.kl_coef > 0``).
- grads: fp32 (FSDP2: the fp32 params' gradients; Megatron: main grads).
- optimizer: AdamW fp32 exp_avg + exp_avg_sq (8 B/param) + fp32 master (4 B) on Megatron with bf16.
- activations: what the HF Llama forward saves for backward, per decoder layer (derived
  from, and checked against, ``saved_tensors_hooks`` on the real model; see
  ``hf_llama_activation_bytes``), for one micro-batch at the configured token budget.
- logits: the [tokens, vocab] logits in the model's dtype, which the log-prob function keeps
  for backward (engine/algorithms/logprobs.py); its fp32 working set of
  ``engine.logprob_chunk_tokens`` rows lives only while a chunk is computed (counted in the
  no-grad passes, where it sits on top of the logits); / TP.
- fp8_workspaces: TE FP8 copies (rowwise + columnwise, 1 B each) of every Linear weight on
  the rank when ``engine.fp8``.
- kv_cache: 2 (K, V) x layers x kv_heads x head_dim x dtype x tokens for the sequences the
  rollout generates at once (vLLM: its memory pool when the device size is known).

Which categories must be on the device in each phase, and which offload moves away, gives
the per-phase totals, the offload what-if matrix and the ranked fixes.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from engine import json_safe
from engine.config.resolved import versions_ahead
from engine.config.schema import RunConfig
from engine.errors import ConfigError
from engine.memory.report import (CATEGORIES, OFFLOAD_MODES, Fix, MemoryEstimate, PhaseEstimate,
                                  WhatIfRow)

GiB = 1 << 30


@dataclass(frozen=True)
class ModelDims:
    """The architecture numbers the estimate needs (Llama-style decoder)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0                      # 0 = hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


# Public architecture numbers (model cards / config.json of the released checkpoints).
BUILTIN_MODELS: dict[str, ModelDims] = {
    "llama-7b": ModelDims("llama-7b", 32000, 4096, 11008, 32, 32, 32, max_position_embeddings=4096),
    "llama-13b": ModelDims("llama-13b", 32000, 5120, 13824, 40, 40, 40, max_position_embeddings=4096),
    "llama-70b": ModelDims("llama-70b", 32000, 8192, 28672, 80, 64, 8, max_position_embeddings=4096),
    "llama3-8b": ModelDims("llama3-8b", 128256, 4096, 14336, 32, 32, 8, max_position_embeddings=8192),
    "llama3-70b": ModelDims("llama3-70b", 128256, 8192, 28672, 80, 64, 8, max_position_embeddings=8192),
}


# ---- the architecture, on the meta device ------------------------------------------------
@dataclass
class ModelStructure:
    """Parameter counts by role, read off the meta-device model."""

    source: str
    dims: ModelDims
    total: int
    embed: int
    lm_head: int                           # 0 when tied to the embedding
    final_norm: int
    layer: list                            # params per decoder layer
    layer_replicated: list                 # of which not split by TP (norms)
    layer_linear: list                     # of which nn.Linear weights (TE FP8 copies them)
    other: int = 0                         # anything else (replicated)
    moe: Optional[dict] = None             # mixture of experts: layers, experts, top_k, expert/router params

    @property
    def largest_layer(self) -> int:
        return max(self.layer) if self.layer else 0


def _hf_config_for_dims(dims: ModelDims):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
                       intermediate_size=dims.intermediate_size, num_hidden_layers=dims.num_layers,
                       num_attention_heads=dims.num_attention_heads,
                       num_key_value_heads=dims.num_key_value_heads, head_dim=dims.d,
                       max_position_embeddings=dims.max_position_embeddings,
                       tie_word_embeddings=dims.tie_word_embeddings, attention_bias=dims.attention_bias)


def _dims_from_hf_config(cfg, name: str) -> ModelDims:
    def get(*keys, default=None):
        for k in keys:
            v = getattr(cfg, k, None)
            if v is not None:
                return v
        return default

    heads = get("num_attention_heads", "n_head")
    hidden = get("hidden_size", "n_embd", "d_model")
    if heads is None or hidden is None or get("num_hidden_layers", "n_layer") is None:
        raise ConfigError(f"{name}: config.json lacks hidden_size / num_attention_heads / num_hidden_layers; "
                          "the estimate supports decoder-only (Llama/Qwen/Mistral-style) models.",
                          title="unsupported model config")
    return ModelDims(
        name=name, vocab_size=int(get("vocab_size")), hidden_size=int(hidden),
        intermediate_size=int(get("intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)),
        num_layers=int(get("num_hidden_layers", "n_layer")), num_attention_heads=int(heads),
        num_key_value_heads=int(get("num_key_value_heads", default=heads)),
        head_dim=int(get("head_dim", default=0) or 0),
        max_position_embeddings=int(get("max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        attention_bias=bool(get("attention_bias", default=False)))


def _structure_from_hf_config(hf_cfg, source: str, dims: ModelDims) -> ModelStructure:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    n_layers = dims.num_layers
    layer = [0] * n_layers
    layer_rep = [0] * n_layers
    layer_lin = [0] * n_layers
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    embed = lm_head = final_norm = other = 0
    in_embed = {id(p) for p in model.get_input_embeddings().parameters()}
    out_emb = model.get_output_embeddings()
    in_head = {id(p) for p in out_emb.parameters()} if out_emb is not None else set()
    for name, p in model.named_parameters():       # tied params appear once
        n = p.numel()
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts) and parts[parts.index("layers") + 1].isdigit():
            i = int(parts[parts.index("layers") + 1])
            layer[i] += n
            if p.dim() == 1 and "norm" in name:
                layer_rep[i] += n
            if id(p) in linear_weights:
                layer_lin[i] += n
        elif id(p) in in_embed:
            embed += n
        elif id(p) in in_head:
            lm_head += n
        elif "norm" in name:
            final_norm += n
        else:
            other += n
    total = sum(p.numel() for p in model.parameters())
    return ModelStructure(source, dims, total, embed, lm_head, final_norm, layer, layer_rep, layer_lin, other,
                          moe=_moe_structure(model))


def _moe_structure(model) -> Optional[dict]:
    """Experts and routers of a (meta-device) MoE model; None for a dense one."""
    from engine.moe.routers import find_routers, moe_layout

    layout = moe_layout(model)
    if layout is None:
        return None
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared_expert" not in n)
    routers = sum(p.numel() for _, r in find_routers(model) for p in r.parameters())
    return {"moe_layers": layout.layers, "experts_per_layer": layout.num_experts, "top_k": layout.top_k,
            "expert_params": experts, "router_params": routers}


def routing_record_bytes(moe: dict, tokens: int) -> int:
    """Bytes of int16 routing records (algorithm.router_replay) for ``tokens`` tokens."""
    return tokens * moe["moe_layers"] * moe["top_k"] * 2


def model_structure(run_cfg: RunConfig, *, model=None, hf_config_path: Optional[str] = None,
                    vocab_size: Optional[int] = None) -> ModelStructure:
    """Build the architecture on the meta device and count its parameters by role.

    ``model``: a BUILTIN_MODELS name or a ModelDims; ``hf_config_path``: a local HF directory
    (or its config.json); otherwise ``run_cfg.model``: ``model.path`` (a directory, or a
    built-in name), a non-tiny preset, or the tiny dims with ``vocab_size`` (default: the
    built-in task's character vocabulary).
    """
    if isinstance(model, ModelDims):
        return _structure_from_hf_config(_hf_config_for_dims(model), model.name, model)
    if isinstance(model, str):
        if model not in BUILTIN_MODELS:
            raise ConfigError(f"unknown model {model!r} for the estimate; built-in configs: "
                              f"{', '.join(BUILTIN_MODELS)} (or give a local HF directory).",
                              title="unknown model")
        dims = BUILTIN_MODELS[model]
        return _structure_from_hf_config(_hf_config_for_dims(dims), f"built-in {model}", dims)
    path = hf_config_path or run_cfg.model.path
    if path and not os.path.exists(os.path.expanduser(path)) and path in BUILTIN_MODELS:
        return model_structure(run_cfg, model=path)
    if not path and run_cfg.model.preset in BUILTIN_MODELS:
        return model_structure(run_cfg, model=run_cfg.model.preset)
    if not path and run_cfg.model.preset != "tiny":
        from engine.model.presets import resolve_model_path

        path = resolve_model_path(run_cfg.model)
    if path:
        return _structure_from_dir(os.path.expanduser(path))
    from engine.model.build import tiny_hf_config

    v = vocab_size or tiny_vocab_size(run_cfg)
    hf_cfg = tiny_hf_config(run_cfg.model, v)
    dims = _dims_from_hf_config(hf_cfg, "tiny")
    return _structure_from_hf_config(hf_cfg, f"tiny (model.* dims, vocab {v})", dims)


def _structure_from_dir(path: str) -> ModelStructure:
    from transformers import AutoConfig

    cfg_file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"{path!r} has no config.json. Point model.path at a local Hugging Face model "
                          f"directory, or estimate a built-in config: {', '.join(BUILTIN_MODELS)}.",
                          title="no model config")
    try:
        from engine.model.source import HF_LOAD_KWARGS

        hf_cfg = AutoConfig.from_pretrained(os.path.dirname(cfg_file), **HF_LOAD_KWARGS)
    except (ValueError, KeyError, OSError) as e:
        with open(cfg_file) as f:
            mt = json_safe.loads(f.read()).get("model_type", "?")
        raise ConfigError(f"transformers cannot read {cfg_file} (model_type={mt!r}): {e}. The estimate "
                          "supports architectures transformers ships (no remote code).",
                          title="unsupported model config") from e
    if getattr(hf_cfg, "text_config", None) is not None and not hasattr(hf_cfg, "num_hidden_layers"):
        hf_cfg = hf_cfg.text_config
    dims = _dims_from_hf_config(hf_cfg, os.path.basename(os.path.dirname(cfg_file).rstrip("/")) or path)
    return _structure_from_hf_config(hf_cfg, cfg_file, dims)


def tiny_vocab_size(run_cfg: RunConfig) -> int:
    """The built-in character tokenizer's vocabulary for the configured task."""
    from engine.model.tokenizer import CharTokenizer
    from engine.tasks.registry import make_task

    task = make_task(run_cfg.task, run_cfg.trainer.seed)
    return CharTokenizer(task.alphabet).vocab_size


# ---- activation formula -------------------------------------------------------------------
def hf_llama_activation_bytes(dims: ModelDims, *, seqs: int, seq_len: int, dtype_bytes: int,
                              attn_implementation: str = "sdpa", padded: bool = True,
                              gradient_checkpointing: bool = False, tp: int = 1,
                              sequence_parallel: bool = False, layers: Optional[int] = None) -> dict:
    """Bytes the HF Llama forward saves for backward, for ``seqs`` x ``seq_len`` tokens.

    Per decoder layer (s = tokens, b = seqs, t = seq_len, a = dtype bytes; fp32 parts stay 4):
      2 RMSNorms: fp32 input copy 4sh + normalized a*sh + output (the next matmul's input) a*sh
                  + fp32 rsqrt 4s
      attention:  q a*s*nh*d, k and v a*s*kv*d each (kv = nh when sdpa repeats them: GQA with a
                  padding mask), output a*s*nh*d (also o_proj's input), log-sum-exp 4*b*nh*t,
                  the padding mask a*b*t^2 (sdpa with a mask);
                  eager instead keeps fp32 softmax 4*b*nh*t^2 (+ a*b*nh*t^2 when a != 4) and
                  o_proj's input a*s*nh*d, no lse/mask; flash_attention_2 no mask, no repeat
      MLP:        gate, act(gate), up, act*up: 4 a*s*i
    plus the final RMSNorm, the token ids (8s) and the rotary cos/sin (2 a*t*d).
    Gradient checkpointing keeps each layer's input (a*s*h) plus one layer being recomputed.
    Megatron-style TP divides the attention and MLP parts by ``tp`` (norms too with sequence
    parallelism). Returns {"total", "per_layer", "formula"}.
    """
    s, b, t, a = seqs * seq_len, seqs, seq_len, dtype_bytes
    h, i, nh, kv, d = dims.hidden_size, dims.intermediate_size, dims.num_attention_heads, dims.num_key_value_heads, dims.d
    n_layers = dims.num_layers if layers is None else layers
    impl = attn_implementation
    norm = 4 * s * h + a * s * h + a * s * h + 4 * s
    kv_saved = nh if (impl in ("sdpa", "eager") and padded and kv != nh) else kv
    if impl == "eager":
        attn = a * s * nh * d + 2 * a * s * kv_saved * d + 4 * b * nh * t * t + a * s * nh * d
        if a != 4:
            attn += a * b * nh * t * t
    else:
        attn = 2 * a * s * nh * d + 2 * a * s * kv_saved * d + 4 * b * nh * t
        if impl == "sdpa" and padded:
            attn += a * b * t * t
    mlp = 4 * a * s * i
    norm_div = tp if sequence_parallel else 1
    per_layer = 2 * norm // norm_div + (attn + mlp) // tp
    rest = norm // norm_div + 8 * s + 2 * a * t * d
    if gradient_checkpointing:
        total = n_layers * a * s * h // norm_div + per_layer + rest
        formula = f"checkpointed: {n_layers} x a*s*h + 1 layer {per_layer:,} B + final norm/ids"
    else:
        total = n_layers * per_layer + rest
        formula = (f"{n_layers} layers x {per_layer:,} B (norms 2x(4sh+2a*sh+4s), attn {impl}, MLP 4a*s*i)"
                   f" + final norm/ids {rest:,} B; s={s:,} tokens")
    return {"total": int(total), "per_layer": int(per_layer), "formula": formula}


# ---- layout and shapes -------------------------------------------------------------------
@dataclass
class _Layout:
    backend: str
    nprocs: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    dist_opt: bool = False
    ep: int = 1          # megatron MoE: ranks the experts of each layer are split over


def _layout(run_cfg: RunConfig) -> _Layout:
    e = run_cfg.engine
    n = run_cfg.trainer.nprocs
    if e.name != "megatron":
        return _Layout("fsdp", n, n)
    tp = getattr(e, "tensor_model_parallel_size", 1)
    pp = getattr(e, "pipeline_model_parallel_size", 1)
    cp = getattr(e, "context_parallel_size", 1)
    mp = tp * pp * cp
    if n % mp:
        raise ConfigError(f"trainer.nprocs={n} is not a multiple of TP x PP x CP = {tp} x {pp} x {cp} = {mp}. "
                          f"Set trainer.nprocs to a multiple of {mp}, or reduce the parallel sizes.",
                          title="invalid parallel layout")
    return _Layout("megatron", n, n // mp, tp, pp, cp, bool(getattr(e, "sequence_parallel", False)) and tp > 1,
                   bool(getattr(e, "use_distributed_optimizer", True)), int(getattr(e, "expert_model_parallel_size", 1)))


def _dtype_bytes(run_cfg: RunConfig) -> int:
    return 2 if run_cfg.model.dtype == "bfloat16" else 4


def _params_on_rank(st: ModelStructure, lay: _Layout) -> tuple[int, int]:
    """(params on the most-loaded rank, Linear weights among them)."""
    if lay.backend == "fsdp":
        lin = sum(st.layer_linear)
        return math.ceil(st.total / lay.dp), math.ceil(lin / lay.dp)
    per_stage = math.ceil(len(st.layer) / lay.pp)
    best = (0, 0)
    for k in range(lay.pp):
        idx = range(k * per_stage, min(len(st.layer), (k + 1) * per_stage))
        split = sum(st.layer[i] - st.layer_replicated[i] for i in idx)
        rep = sum(st.layer_replicated[i] for i in idx)
        lin = sum(st.layer_linear[i] for i in idx) // lay.tp
        n = split // lay.tp + rep
        if st.moe and lay.ep > 1:  # each EP rank holds 1/ep of every layer's experts (MoE runs at TP=1)
            away = st.moe["expert_params"] * len(idx) // max(st.moe["moe_layers"], 1)
            away -= away // lay.ep
            n, lin = n - away, lin - away
        if k == 0:
            n += st.embed // lay.tp + st.other
        if k == lay.pp - 1:
            n += st.final_norm + (st.lm_head or (st.embed if lay.pp > 1 else 0)) // lay.tp
            lin += st.lm_head // lay.tp
        best = max(best, (n, lin))
    return best


@dataclass
class _Shapes:
    seq_len: int
    seqs_per_step: int                     # sequences per rank per RL step
    mini_batch_seqs: int
    micro_seqs: int
    micro_tokens: int
    rollout_seqs: int


def _shapes(run_cfg: RunConfig, lay: _Layout, seq_len: Optional[int]) -> _Shapes:
    from engine.config.lengths import longest_sequence

    t = seq_len or longest_sequence(run_cfg)
    per_step = run_cfg.data.train_batch_size * run_cfg.algorithm.rollout_n
    per_rank = math.ceil(per_step / lay.dp)
    mb = run_cfg.algorithm.ppo_mini_batch_size
    mini = math.ceil(mb * run_cfg.algorithm.rollout_n / lay.dp) if mb else per_rank
    e = run_cfg.engine
    micro = e.micro_batch_size or max(1, e.max_tokens_per_micro_batch // t)
    micro = max(1, min(micro, mini))
    if e.pad_to_length and e.pad_to_length_bucket > 1:
        t_pad = math.ceil(t / e.pad_to_length_bucket) * e.pad_to_length_bucket
    else:
        t_pad = t
    roll = run_cfg.rollout.micro_batch_size or per_rank
    return _Shapes(t_pad, per_rank, mini, micro, micro * t_pad, min(roll, per_rank))


# ---- the arithmetic -----------------------------------------------------------------------
# (in, out) features of the Linear layers LoRA usually targets, per decoder layer, by name
def _linear_shapes(dims: ModelDims) -> dict[str, list[tuple[int, int]]]:
    h, i, d = dims.hidden_size, dims.intermediate_size, dims.d
    q, kv = dims.num_attention_heads * d, dims.num_key_value_heads * d
    return {"q_proj": [(h, q)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(q, h)],
            "gate_proj": [(h, i)], "up_proj": [(h, i)], "down_proj": [(i, h)],
            "c_attn": [(h, 3 * h)], "c_fc": [(h, i)], "c_proj": [(h, h), (i, h)],          # GPT-2
            "query_key_value": [(h, 3 * h)], "dense": [(h, h)],                               # GPT-NeoX
            "dense_h_to_4h": [(h, i)], "dense_4h_to_h": [(i, h)]}


def lora_trainable_params(dims: ModelDims, rank: int, targets: list[str]) -> tuple[int, str]:
    """LoRA parameters (A: r x in, B: out x r per adapted Linear) over all layers, and which
    modules were counted. No targets = peft's Llama default (q_proj, v_proj)."""
    shapes = _linear_shapes(dims)
    names = [t for t in (targets or ["q_proj", "v_proj"]) if t in shapes]
    if targets == ["all-linear"]:
        names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    per_layer = sum(rank * (fin + fout) for n in names for fin, fout in shapes[n])
    return per_layer * dims.num_layers, ", ".join(names) or "no known module"


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.2f} MiB"


def _compute(st: ModelStructure, run_cfg: RunConfig, *, seq_len: Optional[int], device_memory_bytes: Optional[int],
             attn_implementation: str, param_offload: bool, optimizer_offload: bool,
             activation_offload: bool = False) -> dict:
    """Per-phase device bytes for one config and offload setting (no model building)."""
    lay = _layout(run_cfg)
    sh = _shapes(run_cfg, lay, seq_len)
    a = _dtype_bytes(run_cfg)
    dims = st.dims
    e = run_cfg.engine
    bf16 = a == 2
    n_rank, lin_rank = _params_on_rank(st, lay)
    has_ref = run_cfg.algorithm.kl_coef > 0
    vllm = run_cfg.rollout.name == "vllm"
    ahead = versions_ahead(run_cfg) > 0  # the rollout worker samples (with vLLM when asked); the ranks validate
    rank_vllm = vllm and not ahead       # with the torch sampler
    f: dict[str, str] = {}

    # params / grads / optimizer. FSDP2 keeps fp32 parameters whatever model.dtype says (its
    # mixed-precision policy casts a compute copy of each gathered unit to the low precision), so
    # they and their gradients are 4 B and AdamW needs no separate master copy; megatron keeps the
    # params in model.dtype with fp32 main grads and an fp32 master in the optimizer.
    pb = 4 if lay.backend == "fsdp" else a
    params = n_rank * pb
    f["params"] = f"{n_rank:,} params on the rank x {pb} B" + (" (fp32 masters; bf16 compute copies)"
                                                              if pb != a else "")
    gather = 0
    if lay.backend == "fsdp" and lay.dp > 1:
        root = st.embed + st.lm_head + st.final_norm + st.other
        gather = (root + 2 * st.largest_layer) * a
        f["params"] += f" + all-gathered root unit and 2 layers in flight ({_fmt(gather)})"
    ref = params if has_ref else 0
    if has_ref:
        f["params"] += " + frozen reference policy (same size)"
    grad_b = 4  # FSDP2: the fp32 parameters' gradients (reduced in fp32); megatron: fp32 main grads
    grads = n_rank * grad_b + (st.largest_layer * a if gather else 0)
    f["grads"] = f"{n_rank:,} x {grad_b} B ({'fp32, as the params' if lay.backend == 'fsdp' else 'fp32 main grads'})"
    opt_b = 8 + (4 if bf16 and lay.backend != "fsdp" else 0)
    opt_div = lay.dp if (lay.backend == "fsdp" or lay.dist_opt) else 1
    opt_params = n_rank if lay.backend == "fsdp" else math.ceil(n_rank / opt_div)
    optimizer = opt_params * opt_b
    f["optimizer"] = (f"{opt_params:,} x {opt_b} B (AdamW fp32 m, v{' + fp32 master' if opt_b > 8 else ''})"
                      + (f", sharded over DP={opt_div}" if opt_div > 1 else ""))
    lora = run_cfg.model.lora
    if lora.rank:  # only the adapters have gradients and AdamW state; the base is frozen
        n_lora, what = lora_trainable_params(dims, lora.rank, list(lora.target_modules))
        lora_rank = math.ceil(n_lora / lay.dp)
        params += lora_rank * pb
        f["params"] += f" + LoRA adapters {lora_rank:,} x {pb} B"
        grads = lora_rank * grad_b  # frozen base: no full-layer gradient buffer in flight either
        f["grads"] = (f"LoRA only: {lora_rank:,} adapter params x {grad_b} B (rank {lora.rank} on {what}; "
                      f"base weights frozen, no grads)")
        optimizer = lora_rank * opt_b
        f["optimizer"] = f"LoRA only: {lora_rank:,} adapter params x {opt_b} B (AdamW m, v)"

    # activations and logits for one micro-batch
    seqs_cp = sh.micro_seqs
    t_cp = max(1, sh.seq_len // lay.cp)
    layers_rank = math.ceil(dims.num_layers / lay.pp)
    act = hf_llama_activation_bytes(
        dims, seqs=seqs_cp, seq_len=t_cp, dtype_bytes=a,
        attn_implementation="flash_attention_2" if lay.backend == "megatron" else attn_implementation,
        gradient_checkpointing=e.gradient_checkpointing, tp=lay.tp, sequence_parallel=lay.sp,
        layers=layers_rank)
    in_flight = min(lay.pp, max(1, math.ceil(sh.mini_batch_seqs / sh.micro_seqs))) if lay.pp > 1 else 1
    activations = act["total"] * in_flight
    act_host = 0
    if activation_offload:  # engine/memory/activation_offload.py: decoder layers' saved tensors
        s_tok = seqs_cp * t_cp
        unit = (dims.hidden_size * s_tok * a // (lay.tp if lay.sp else 1)) if e.gradient_checkpointing \
            else act["per_layer"]
        act_host = min(layers_rank * unit * in_flight, int(e.activation_offload_host_cache_limit_gb * (1 << 30)))
        activations = activations - act_host + min(act_host, 2 * unit)  # computing + prefetched layer
    f["activations"] = act["formula"] + (f" x {in_flight} micro-batches in flight (1F1B)" if in_flight > 1 else "")
    if act_host:
        f["activations"] += (f"; offloaded to host: {_fmt(act_host)} ({layers_rank} layers x {unit:,} B, capped at "
                             f"{e.activation_offload_host_cache_limit_gb} GiB), 2 layers in flight on the device")
    tokens = seqs_cp * t_cp
    v_rank = math.ceil(dims.vocab_size / lay.tp)
    # engine/algorithms/logprobs.py keeps only the logits (model dtype) for backward and works in
    # fp32 on chunks of positions (z and exp(z - max): 8 B per element), freed chunk by chunk
    chunk = min(tokens, e.logprob_chunk_tokens) * v_rank * 8
    logits_eval = tokens * v_rank * a + chunk
    if getattr(e, "fused_lm_head", False):  # engine/backends/fused_head.py: no pass makes the logits
        logits_train, logits_eval = 0, chunk
        f["logits"] = (f"none, in the update or the no-grad passes (engine.fused_lm_head: the output layer computes "
                       f"the log-probs {min(tokens, e.logprob_chunk_tokens):,} positions at a time, a {_fmt(chunk)} "
                       f"fp32 working set)")
    else:
        logits_train = tokens * v_rank * a
        f["logits"] = (f"{tokens:,} tokens x {v_rank:,} vocab x {a} B (the logits, kept for backward; the log-probs "
                       f"are computed {min(tokens, e.logprob_chunk_tokens):,} positions at a time in fp32, a "
                       f"{_fmt(chunk)} working set that lives only while each chunk is computed)")
    uses_fp8 = e.fp8 and e.name == "megatron"  # only megatron builds TE layers (fsdp refuses fp8)
    fp8 = 2 * lin_rank if uses_fp8 else 0
    if uses_fp8:
        f["fp8_workspaces"] = f"{lin_rank:,} Linear weights x 2 B (FP8 rowwise + columnwise)"

    # rollout
    full = st.total * a
    kv_per_token = 2 * dims.num_layers * dims.num_key_value_heads * dims.d * a
    kv_need = kv_per_token * sh.seq_len * sh.rollout_seqs
    gen_copy = full if (rank_vllm or params < full) else 0
    kv = kv_need
    f["kv_cache"] = f"{kv_per_token:,} B/token x {sh.seq_len} x {sh.rollout_seqs} sequences"
    if rank_vllm and device_memory_bytes:
        pool = int(run_cfg.rollout.gpu_memory_utilization * device_memory_bytes) - full
        kv = max(pool, 0)
        f["kv_cache"] = (f"vLLM pool: gpu_memory_utilization {run_cfg.rollout.gpu_memory_utilization} x device "
                         f"- weights {_fmt(full)} (the batch needs {_fmt(kv_need)})")
    sample_logits = sh.rollout_seqs * dims.vocab_size * 4 * 2
    worker = None
    if ahead:  # engine/trainer/rollout_worker.py: its own full copy, the whole batch at once
        rows = run_cfg.data.train_batch_size * run_cfg.algorithm.rollout_n
        at_once = rows if vllm else min(rows, run_cfg.rollout.micro_batch_size or rows)
        w_kv = kv_per_token * sh.seq_len * at_once
        if vllm and device_memory_bytes:
            w_kv = max(int(run_cfg.rollout.gpu_memory_utilization * device_memory_bytes) - full, 0)
        worker = {"params": full, "kv_cache": w_kv, "logits": at_once * dims.vocab_size * 4 * 2}
        worker["total"] = sum(worker.values())
        f["rollout_worker"] = (f"the policy unsharded ({st.total:,} x {a} B) + KV cache {kv_per_token:,} B/token x "
                               f"{sh.seq_len} x {at_once} sequences" + (" (vLLM's pool)" if vllm and device_memory_bytes
                                                                        else "") + " + sampling logits")

    # what must be on the device in each phase
    resident_params = 0 if param_offload else params + ref
    resident_opt = 0 if optimizer_offload else optimizer
    resident_fp8 = 0 if param_offload else fp8
    phases = []

    def add(name, **cats):
        cats = {c: int(cats.get(c, 0)) for c in CATEGORIES}
        phases.append(PhaseEstimate(name, cats, sum(v for c, v in cats.items() if c != "activations_host")))

    roll_params = (resident_params if rank_vllm else params + (0 if param_offload else ref)) + gen_copy
    if worker is None or run_cfg.trainer.val_freq:  # sampling ahead: the ranks sample only to validate
        add("rollout", params=roll_params, optimizer=resident_opt, logits=sample_logits,
            fp8_workspaces=resident_fp8, kv_cache=kv)
    if rank_vllm:
        add("weight_sync", params=resident_params + params + gen_copy, optimizer=resident_opt,
            fp8_workspaces=resident_fp8)
    add("old_log_probs", params=params + gather + (0 if param_offload else ref), optimizer=resident_opt,
        logits=logits_eval, fp8_workspaces=fp8)
    if has_ref:
        add("ref_log_probs", params=ref + gather + (0 if param_offload else params), optimizer=resident_opt,
            logits=logits_eval, fp8_workspaces=fp8)
    add("update", params=params + gather + (0 if param_offload else ref), grads=grads, optimizer=optimizer,
        activations=activations, activations_host=act_host, logits=logits_train, fp8_workspaces=fp8)
    critic = critic_opt = 0
    if run_cfg.algorithm.name == "ppo":
        # engine/backends/fsdp/critic.py, engine/backends/megatron/critic.py: a copy of the network
        # (same layout), its own AdamW; offloaded with the policy by param/optimizer_offload
        critic, critic_opt = params, optimizer
        critic_res = 0 if param_offload else critic
        critic_opt_res = 0 if optimizer_offload else critic_opt
        f["params"] += (" + critic (a copy of the policy network with a value head; "
                        + ("offloaded with the policy outside critic_update)" if param_offload
                           else "resident in every phase)"))
        f["optimizer"] += " + the critic's AdamW state (same size)"
        for ph in phases:
            ph.categories["params"] += critic_res
            ph.categories["optimizer"] += critic_opt_res
            ph.total += critic_res + critic_opt_res
        add("critic_update", params=critic + gather + resident_params, grads=grads,
            optimizer=critic_opt + resident_opt, activations=activations, fp8_workspaces=resident_fp8)
        optimizer += critic_opt
    peak = max(phases, key=lambda p: p.total)
    host = (params + ref + critic if param_offload else 0) + (optimizer if optimizer_offload else 0) + act_host
    per_rank = {"params": params + gather + ref + critic, "grads": grads, "optimizer": optimizer,
                "activations": activations, "activations_host": act_host, "logits": logits_train,
                "fp8_workspaces": fp8, "kv_cache": kv}
    assumptions = {
        "seq_len": sh.seq_len, "sequences_per_rank_per_step": sh.seqs_per_step,
        "mini_batch_sequences_per_rank": sh.mini_batch_seqs, "micro_batch_sequences": sh.micro_seqs,
        "micro_batch_tokens": sh.micro_tokens, "rollout_sequences_at_once": sh.rollout_seqs,
        "param_dtype": run_cfg.model.dtype, "attn_implementation": attn_implementation if lay.backend == "fsdp" else "flash (TE)",
        "gradient_checkpointing": e.gradient_checkpointing, "activation_offload": activation_offload,
        "reference_policy": has_ref,
        "rollout": run_cfg.rollout.name, "grads_released_after_step": True,
        "offload_schedule": "offloaded state is brought back only for the phases that use it",
    }
    if worker is not None:  # while the ranks update, the worker samples the next batch
        worker["rank0_peak_if_shared"] = peak.total + worker["total"]
    return {"layout": lay, "shapes": sh, "phases": phases, "peak": peak, "host": host, "per_rank": per_rank,
            "formulas": f, "assumptions": assumptions, "params_rank": n_rank, "model_bytes": full, "worker": worker}


def _with_overrides(run_cfg: RunConfig, overrides: dict) -> RunConfig:
    cfg = copy.deepcopy(run_cfg)
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        setattr(getattr(cfg, section), name, value)
    return cfg


def _fits(total: int, device: Optional[int]) -> tuple[Optional[bool], Optional[int]]:
    if not device:
        return None, None
    return total <= device, device - total


def _vllm_share_fix(run_cfg: RunConfig, cur: dict, device: Optional[int]) -> list[tuple[str, dict, str]]:
    """vLLM on the ranks takes ``rollout.gpu_memory_utilization`` of the whole device for its weights
    and KV pool, beside the trainer's resident state (the AdamW state too, which exists from the
    first update on: vLLM's start checks against memory free before it, its wake after each update
    does not). The largest share with which the rollout phase fits, when that is smaller than the
    one set and still holds vLLM's weights with some room for KV; else nothing."""
    util = run_cfg.rollout.gpu_memory_utilization
    rollout = next((p for p in cur["phases"] if p.phase == "rollout"), None)
    if not device or rollout is None or run_cfg.rollout.name != "vllm" or versions_ahead(run_cfg) > 0:
        return []
    share = int(util * device)
    if share < cur["model_bytes"] or rollout.total <= device:  # no pool at all, or it fits
        return []
    rest = rollout.total - share  # the trainer's resident state and the sampling logits
    fit = math.floor((device - rest) / device * 100) / 100
    if fit >= util or fit * device < cur["model_bytes"] * 1.1:
        return []
    return [("smaller vLLM share", {"rollout.gpu_memory_utilization": fit},
             "vLLM's weights and KV pool beside the trainer's resident state (AdamW's included) in the rollout")]


def _candidate_fixes(run_cfg: RunConfig, lay: _Layout, sh: _Shapes) -> list[tuple[str, dict, str]]:
    e, out = run_cfg.engine, []
    if not e.param_offload:
        out.append(("param offload", {"engine.param_offload": True},
                    "params (and FP8 workspaces) leave the device while the phases that do not use them run"))
    if not e.optimizer_offload:
        out.append(("optimizer offload", {"engine.optimizer_offload": True},
                    "optimizer state is on the device only for the update"))
    if not e.activation_offload:
        out.append(("activation offload", {"engine.activation_offload": True},
                    "decoder layers' saved activations wait in host memory between forward and backward"))
    if not e.gradient_checkpointing:
        out.append(("gradient checkpointing", {"engine.gradient_checkpointing": True},
                    "keep only each layer's input; recompute the rest in backward"))
    if sh.micro_seqs > 1:
        half = max(sh.seq_len, e.max_tokens_per_micro_batch // 2)
        ov = {"engine.max_tokens_per_micro_batch": half}
        if e.micro_batch_size:
            ov = {"engine.micro_batch_size": max(1, e.micro_batch_size // 2)}
        out.append(("smaller micro-batches", ov, "halve the tokens per forward/backward"))
    if run_cfg.rollout.name == "torch" and sh.rollout_seqs > 1:
        out.append(("smaller rollout batches", {"rollout.micro_batch_size": max(1, sh.rollout_seqs // 2)},
                    "generate half as many sequences at once (KV cache)"))
    if lay.backend == "fsdp":
        out.append(("shard over 2x ranks", {"trainer.nprocs": 2 * lay.nprocs},
                    "FSDP divides params, grads and optimizer state by the rank count"))
    else:
        if not lay.dist_opt:
            out.append(("distributed optimizer", {"engine.use_distributed_optimizer": True},
                        "shard optimizer state over data-parallel ranks"))
        if lay.dp % 2 == 0:
            out.append(("2x tensor parallel", {"engine.tensor_model_parallel_size": 2 * lay.tp},
                        "split matrices, vocabulary and activations over twice the ranks"))
    if run_cfg.model.dtype == "float32":
        out.append(("bf16 params", {"model.dtype": "bfloat16"},
                    "2-byte activations and gathered weights (FSDP2 keeps fp32 masters and grads)"
                    if lay.backend == "fsdp" else "2-byte params and activations"))
    return out


def estimate_memory(run_cfg: RunConfig, *, model=None, hf_config_path: Optional[str] = None,
                    vocab_size: Optional[int] = None, seq_len: Optional[int] = None,
                    device_memory_bytes: Optional[int] = None,
                    attn_implementation: str = "sdpa") -> MemoryEstimate:
    """Per-rank memory estimate for ``run_cfg`` (see the module docstring).

    ``seq_len``: padded tokens per sequence (default: data.max_prompt_length +
    rollout.max_new_tokens, the longest possible). ``device_memory_bytes``: the device to
    check against (default: this machine's CUDA device, if any; else fits is unknown).
    """
    st = model_structure(run_cfg, model=model, hf_config_path=hf_config_path, vocab_size=vocab_size)
    if device_memory_bytes is None:
        device_memory_bytes = _local_device_memory()
    kw = dict(seq_len=seq_len, device_memory_bytes=device_memory_bytes, attn_implementation=attn_implementation)
    budget_note = None
    if run_cfg.engine.max_tokens_per_micro_batch == 0 and run_cfg.engine.micro_batch_size == 0:
        run_cfg, budget_note = _fitted_budget(st, run_cfg, seq_len, device_memory_bytes, attn_implementation)
    e = run_cfg.engine
    cur = _compute(st, run_cfg, param_offload=e.param_offload, optimizer_offload=e.optimizer_offload,
                   activation_offload=e.activation_offload, **kw)

    matrix = []
    for mode in OFFLOAD_MODES:
        po, oo = mode in ("param", "both", "all"), mode in ("optimizer", "both", "all")
        ao = mode in ("activations", "all")
        r = cur if (po, oo, ao) == (e.param_offload, e.optimizer_offload, e.activation_offload) else _compute(
            st, run_cfg, param_offload=po, optimizer_offload=oo, activation_offload=ao, **kw)
        fits, head = _fits(r["peak"].total, device_memory_bytes)
        matrix.append(WhatIfRow(mode, [f"engine.param_offload={str(po).lower()}",
                                       f"engine.optimizer_offload={str(oo).lower()}",
                                       f"engine.activation_offload={str(ao).lower()}"],
                                r["peak"].total, r["peak"].phase, r["host"], fits, head))

    fixes = []
    candidates = _candidate_fixes(run_cfg, cur["layout"], cur["shapes"])
    for name, ov, why in candidates + _vllm_share_fix(run_cfg, cur, device_memory_bytes):
        try:
            cfg2 = _with_overrides(run_cfg, ov)
            r = _compute(st, cfg2, param_offload=cfg2.engine.param_offload,
                         optimizer_offload=cfg2.engine.optimizer_offload,
                         activation_offload=cfg2.engine.activation_offload, **kw)
        except ConfigError:
            continue
        saved = cur["peak"].total - r["peak"].total
        if saved > 0:
            fixes.append(Fix(name, [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ov.items()],
                             saved, r["peak"].total, _fits(r["peak"].total, device_memory_bytes)[0], why))
    fixes.sort(key=lambda x: -x.bytes_saved)

    lay = cur["layout"]
    notes = [budget_note] if budget_note else []
    if lay.backend == "megatron":
        notes.append("megatron activations use the HF Llama per-layer formula with flash attention, "
                     "split by TP (and SP); the most-loaded pipeline stage is reported")
    if run_cfg.rollout.name == "vllm" and not device_memory_bytes:
        notes.append("vLLM KV cache shown as what the batch needs; give the device size to see vLLM's pool")
    moe = None
    if st.moe is not None:
        sh = cur["shapes"]
        moe = dict(st.moe, router_replay=run_cfg.algorithm.router_replay,
                   routing_bytes_rollout_batch=routing_record_bytes(st.moe, sh.seqs_per_step * sh.seq_len),
                   routing_bytes_micro_batch=routing_record_bytes(st.moe, sh.micro_tokens))
        where = (f"1/{lay.ep} of each layer's experts on a rank (engine.expert_model_parallel_size={lay.ep})"
                 if lay.ep > 1 else "every expert's parameters are counted (all experts live on every rank)")
        notes.append(f"mixture of experts: {where}; activations use the dense per-layer formula with config "
                     "intermediate_size, a rough figure for routed MLPs")
    worker = cur["worker"]
    if worker is not None:
        mode = f"trainer.mode={run_cfg.trainer.mode}"
        notes.append(f"{mode}: the rollout worker samples the next batches in its own process, with its own copy "
                     f"of the policy ({_fmt(worker['total'])} in all). On GPUs it takes a GPU of its own when one "
                     f"is free beyond the ranks' {lay.nprocs}; otherwise it shares rank 0's device, "
                     f"where it samples while rank 0 updates: rank 0's peak is then "
                     f"{_fmt(worker['rank0_peak_if_shared'])}" + ("" if run_cfg.trainer.val_freq else
                                                                    "; the ranks themselves sample nothing"))
    return MemoryEstimate(
        model=st.source, param_count=st.total, model_bytes=cur["model_bytes"], backend=lay.backend,
        layout={"nprocs": lay.nprocs, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep},
        dtype=run_cfg.model.dtype, assumptions=cur["assumptions"], per_rank=cur["per_rank"],
        phases=cur["phases"], peak_phase=cur["peak"].phase, peak_bytes=cur["peak"].total,
        device_memory_bytes=device_memory_bytes, offload_matrix=matrix, fixes=fixes[:5],
        formulas=cur["formulas"], notes=notes, moe=moe, rollout_worker=worker)


def _fitted_budget(st: ModelStructure, run_cfg: RunConfig, seq_len: Optional[int], device: Optional[int],
                   attn_implementation: str) -> tuple[RunConfig, str]:
    """engine.max_tokens_per_micro_batch=0: the run's config with the budget the ranks would fit
    to ``device`` bytes (engine/memory/micro_batch_fit.py), or 4096 when the device is unknown."""
    from engine.memory.micro_batch_fit import UNFITTED_BUDGET, fit_token_budget

    if not device:
        return (_with_overrides(run_cfg, {"engine.max_tokens_per_micro_batch": UNFITTED_BUDGET}),
                f"engine.max_tokens_per_micro_batch=0 is fitted to each rank's memory when the run starts; shown "
                f"at {UNFITTED_BUDGET} tokens (give --device-memory to see the fitted budget)")
    fit = fit_token_budget(run_cfg, st, device, seq_len=seq_len, attn_implementation=attn_implementation)
    return (_with_overrides(run_cfg, {"engine.max_tokens_per_micro_batch": fit.tokens}),
            f"engine.max_tokens_per_micro_batch=0 fits this device at {fit.describe()}")


def _local_device_memory() -> Optional[int]:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001 - no device is an answer, not an error
        pass
    return None


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '81920MiB', '1e9' -> bytes (for --device-memory)."""
    t = text.strip().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1, "k": 1 << 10,
             "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    low = t.lower()
    for u in sorted(units, key=len, reverse=True):
        if low.endswith(u):
            num = low[: -len(u)]
            try:
                return int(float(num) * units[u])
            except (ValueError, OverflowError):  # 'nan', 'inf', '1e400': not a size
                break
    try:
        return int(float(low))
    except (ValueError, OverflowError):
        raise ConfigError(f"cannot read {text!r} as a memory size; write e.g. 80GiB, 141GB or 81920MiB.",
                          title="invalid memory size") from None


__all__ = ["BUILTIN_MODELS", "ModelDims", "ModelStructure", "estimate_memory", "hf_llama_activation_bytes",
           "model_structure", "parse_bytes", "tiny_vocab_size"]
