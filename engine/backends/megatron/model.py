"""Build a megatron-core ``GPTModel`` that computes what a transformers Llama/Qwen2 does.

``Arch`` holds the architecture facts read from a Hugging Face config (the tiny built-in
model's config comes from ``engine.model.build.tiny_hf_config``, a local directory's from
its ``config.json``); ``transformer_config`` and ``build_gpt_model`` turn those into the
megatron objects. Covered: RMSNorm, SwiGLU, RoPE (default, linear, llama3), GQA, Qwen2's
q/k/v bias, tied or untied embeddings. Anything else in the HF config that would change the
maths (biases on o_proj/MLP, sliding windows, other RoPE types) is refused with a
``ConfigError`` rather than silently computed differently.

Layer spec: Transformer-Engine's when TE imports (needed for FP8), megatron's local spec
otherwise (CPU). The spec decides whether the pre-attention/pre-MLP norms are separate
modules or fused into the following linear; ``hf_convert`` reads that from ``Arch.fused_norms``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mixtral")
# MoE architectures with no mapping to megatron's expert layout yet (engine=fsdp trains them)
UNMAPPED_MOE_TYPES = ("qwen2_moe", "qwen3_moe", "olmoe", "qwen3_next", "deepseek_v3", "deepseek_v2")


@dataclass(frozen=True)
class Arch:
    """What megatron needs to know about a Llama/Qwen2-family checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling_factor: float = 0.0       # llama3-style scaling factor; 0 = none
    rope_linear_factor: float = 0.0        # linear position interpolation factor; 0 = none
    fused_norms: bool = False              # TE spec: norm weights live in linear_qkv / linear_fc1
    num_experts: int = 0                   # MoE (Mixtral): routed experts per layer; 0 = dense MLP
    moe_top_k: int = 0                     # experts per token

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def queries_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope(hf_config) -> tuple[float, dict]:
    """(theta, scaling dict or {}) across transformers 4.x (rope_theta/rope_scaling) and 5.x
    (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    merged = {**scaling, **params}
    merged.pop("rope_theta", None)
    if merged.get("rope_type", merged.get("type", "default")) == "default":
        merged = {}
    return float(theta), merged


def arch_from_hf_config(hf_config, fused_norms: bool = False) -> Arch:
    """Read and validate a transformers config (LlamaConfig/Qwen2Config or compatible)."""
    mt = getattr(hf_config, "model_type", "")
    if mt in UNMAPPED_MOE_TYPES:
        raise ConfigError(f"engine=megatron maps the MoE architecture mixtral to megatron's expert layout; this "
                          f"model is {mt!r}, which has no mapping yet. Use engine=fsdp for it (it trains every "
                          f"MoE architecture transformers has, with routing replay).", title="unsupported model")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"engine=megatron supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                          f"this model is {mt!r}. Use engine=fsdp for it.", title="unsupported model")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"engine=megatron builds SwiGLU MLPs; hidden_act is {hf_config.hidden_act!r}. "
                          "Use engine=fsdp for this model.", title="unsupported model")
    if mt == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise ConfigError("engine=megatron: Llama with attention_bias/mlp_bias (bias on o_proj/MLP too) is not "
                          "supported; use a Qwen2-style model (q/k/v bias only) or engine=fsdp.",
                          title="unsupported model")
    if mt == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("engine=megatron does not implement Qwen2 sliding-window attention; set "
                          "use_sliding_window=false in the model config or use engine=fsdp.",
                          title="unsupported model")
    theta, scaling = _rope(hf_config)
    llama3 = linear = 0.0
    kind = scaling.get("rope_type", scaling.get("type", ""))
    if kind == "llama3":
        if (scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0),
                scaling.get("original_max_position_embeddings", 8192)) != (1.0, 4.0, 8192):
            raise ConfigError("engine=megatron: llama3 RoPE scaling is supported only with low_freq_factor=1, "
                              "high_freq_factor=4, original_max_position_embeddings=8192 (megatron-core's fixed "
                              "values). Use engine=fsdp for this model.", title="unsupported model")
        llama3 = float(scaling["factor"])
    elif kind == "linear":
        linear = float(scaling["factor"])
    elif scaling:
        raise ConfigError(f"engine=megatron: RoPE type {kind!r} is not supported (default, linear, llama3 are). "
                          "Use engine=fsdp for this model.", title="unsupported model")
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    qkv_bias = True if mt == "qwen2" else False
    experts = int(getattr(hf_config, "num_local_experts", 0) or 0) if mt == "mixtral" else 0
    if mt == "mixtral" and float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0):
        raise ConfigError("engine=megatron: Mixtral's router_jitter_noise is not mapped (megatron's input jitter is "
                          "another noise); set router_jitter_noise=0 in the model config or use engine=fsdp.",
                          title="unsupported model")
    return Arch(model_type=mt, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
                num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=float(hf_config.rms_norm_eps),
                rope_theta=theta, max_position_embeddings=hf_config.max_position_embeddings,
                tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                qkv_bias=qkv_bias, rope_scaling_factor=llama3, rope_linear_factor=linear,
                fused_norms=fused_norms, num_experts=experts,
                moe_top_k=int(getattr(hf_config, "num_experts_per_tok", 0) or 0) if experts else 0)


def te_available() -> bool:
    """Transformer-Engine importable (and a GPU to run it on)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Megatron's vocab-parallel embedding needs the vocab to split evenly over TP ranks;
    the extra rows are zero and masked out of every softmax (see engine/algorithms/logprobs.py)."""
    return -(-vocab_size // tp_size) * tp_size


def check_parallel_layout(arch: Arch, tp: int, ep: int = 1) -> None:
    if ep > 1 and not arch.is_moe:
        raise ConfigError(f"engine.expert_model_parallel_size={ep} splits the experts of a mixture-of-experts "
                          f"model over ranks; this model ({arch.model_type}) has no experts. Set "
                          f"engine.expert_model_parallel_size=1.", title="invalid parallel layout")
    if arch.is_moe and tp > 1:
        raise ConfigError(f"engine=megatron trains MoE models with tensor_model_parallel_size=1 (experts are split "
                          f"with engine.expert_model_parallel_size, the rest is data parallel); "
                          f"tensor_model_parallel_size={tp} with experts is not supported yet. Set "
                          f"engine.tensor_model_parallel_size=1.", title="unsupported parallel layout")
    if arch.is_moe and arch.num_experts % ep:
        fits = [e for e in range(1, arch.num_experts + 1) if arch.num_experts % e == 0]
        raise ConfigError(f"engine.expert_model_parallel_size={ep} must divide the number of experts "
                          f"({arch.num_experts}); this model takes {{{', '.join(map(str, fits))}}}.",
                          title="invalid parallel layout")
    fits = [t for t in range(1, arch.num_heads + 1)
            if not (arch.num_heads % t or arch.num_kv_heads % t or arch.intermediate_size % t)]
    sizes = f" This model takes engine.tensor_model_parallel_size in {{{', '.join(map(str, fits))}}}."
    if arch.num_kv_heads % tp or arch.num_heads % tp:
        raise ConfigError(f"engine.tensor_model_parallel_size={tp} must divide the number of key/value heads "
                          f"({arch.num_kv_heads}) and attention heads ({arch.num_heads}).{sizes}",
                          title="invalid parallel layout")
    if arch.intermediate_size % tp:
        raise ConfigError(f"engine.tensor_model_parallel_size={tp} must divide the MLP size "
                          f"({arch.intermediate_size}).{sizes}", title="invalid parallel layout")


# the compiled CUDA extensions megatron's local spec calls for a fused masked softmax (apex or
# megatron's own fused kernels); Transformer-Engine's spec does not need them
FUSED_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                         "scaled_softmax_cuda")


def missing_fused_softmax_kernels() -> list[str]:
    """The fused-softmax extensions that cannot be imported here (empty: megatron may fuse)."""
    import importlib.util

    missing = []
    for name in FUSED_SOFTMAX_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def fusion_choices(on_gpu: bool, use_te: bool) -> tuple[dict, list[str]]:
    """The TransformerConfig fusion switches for this device and layer spec, and a note for each
    fusion turned off because its kernel is not importable (an issue-40 crash: megatron's local
    spec on a GPU asked for ``scaled_masked_softmax_cuda`` at the first bf16 forward)."""
    notes = []
    softmax = on_gpu
    if on_gpu and not use_te:
        missing = missing_fused_softmax_kernels()
        if missing:
            softmax = False
            notes.append(f"masked-softmax fusion off: megatron's local layer spec needs the compiled "
                         f"{', '.join(missing)} extension(s), which are not importable here (build apex or megatron's "
                         f"fused kernels, or install Transformer-Engine, to fuse it); attention runs unfused")
    return {"bias_activation_fusion": on_gpu, "masked_softmax_fusion": softmax, "bias_dropout_fusion": on_gpu}, notes


def transformer_config(arch: Arch, *, dtype: torch.dtype, tp: int, pp: int = 1, sequence_parallel: bool = False,
                       on_gpu: bool = False, fp8: bool = False, recompute: bool = False, ep: int = 1,
                       aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, routing_replay: bool = False,
                       fusions: dict | None = None):
    """The megatron ``TransformerConfig`` for ``arch``. CPU: no fused kernels, CPU init. ``fusions``:
    what ``fusion_choices`` decided (default: every fusion on a GPU, none on a CPU)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        params_dtype=dtype, bf16=(dtype == torch.bfloat16), pipeline_dtype=dtype,
        # weights come from a HF model, but megatron-core 0.16 only marks TP-sharded weights
        # (``tensor_model_parallel``, used by every grad-norm) inside its init functions, so
        # initialisation must run; build_gpt_model keeps it from moving the global RNG
        perform_initialization=True, use_cpu_initialization=not on_gpu,
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        # fused kernels are CUDA-only, and the masked softmax's needs a compiled extension (fusion_choices)
        **(fusions if fusions is not None else {"bias_activation_fusion": on_gpu, "masked_softmax_fusion": on_gpu,
                                                "bias_dropout_fusion": on_gpu}),
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        cuda_graph_scope=[],   # the default "full" is deprecated and warns on every build
    )
    if arch.is_moe:
        kw.update(moe_kwargs(arch, ep=ep, on_gpu=on_gpu, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef,
                             routing_replay=routing_replay))
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if fp8:
        # amax reduced over the tensor-parallel group only: megatron's default group spans the
        # data-parallel ranks too, whose TE all-reduce runs at every forward, and rl's data-parallel
        # ranks may run different numbers of micro-batches (a hang)
        kw.update(fp8="hybrid", fp8_recipe="delayed", tp_only_amax_red=True)
    return TransformerConfig(**kw)


def moe_kwargs(arch: Arch, *, ep: int, on_gpu: bool, aux_loss_coef: float, z_loss_coef: float,
               routing_replay: bool) -> dict:
    """The MoE part of the TransformerConfig: Mixtral's router is softmax -> top-k -> renormalise,
    which is megatron's top-k on the logits then a softmax over the k (``moe_router_pre_softmax``
    off), in fp32. Per-expert MLPs (no grouped GEMM: it needs TE or the grouped_gemm package), no
    token dropping. Dispatcher: allgather on CPU (megatron's alltoall builds a CUDA stream),
    alltoall on CUDA. Aux loss: ``aux_loss_coef`` is Hugging Face's ``router_aux_loss_coef``
    (Switch load balancing summed over the k slots); megatron's loss averages over them, so its
    coefficient is ``aux_loss_coef * k``. 0 (the default) adds no loss, as the FSDP engine does."""
    balance = "aux_loss" if aux_loss_coef > 0 else "none"
    return dict(num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k,
                moe_ffn_hidden_size=arch.intermediate_size, expert_model_parallel_size=ep,
                moe_token_dispatcher_type="alltoall" if on_gpu else "allgather", moe_grouped_gemm=False,
                moe_router_load_balancing_type=balance, moe_aux_loss_coeff=aux_loss_coef * arch.moe_top_k,
                moe_z_loss_coeff=z_loss_coef or None, moe_router_pre_softmax=False,
                moe_router_score_function="softmax", moe_router_dtype="fp32", moe_permute_fusion=False,
                moe_enable_routing_replay=routing_replay)


def layer_spec(use_te: bool, arch: Arch | None = None):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = arch.num_experts if arch is not None and arch.is_moe else None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False)
    return specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")


def patch_router_gemm() -> None:
    """megatron-core 0.16 imports ``te_general_gemm`` only inside its Transformer-Engine ``try``
    but reads it unconditionally in the router's gating linear: without TE every MoE forward
    raises NameError. ``None`` is the value that makes it take its own torch path."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(arch: Arch, config, use_te: bool, pre_process: bool = True, post_process: bool = True):
    """A ``GPTModel`` with this rank's TP shard shapes (weights uninitialised: load them
    with ``hf_convert``). Requires parallel_state to be initialised."""
    from megatron.core.models.gpt import GPTModel

    tp = config.tensor_model_parallel_size
    with torch.random.fork_rng(devices=[]):
        return _gpt_model(GPTModel, arch, config, use_te, tp, pre_process, post_process)


def _gpt_model(GPTModel, arch: Arch, config, use_te: bool, tp: int, pre_process: bool, post_process: bool):
    if arch.is_moe:
        patch_router_gemm()
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec(use_te, arch),
        vocab_size=padded_vocab_size(arch.vocab_size, tp), max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor > 0, rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        seq_len_interpolation_factor=arch.rope_linear_factor or None,
    )


def with_fused_norms(arch: Arch, fused: bool) -> Arch:
    return replace(arch, fused_norms=fused)
