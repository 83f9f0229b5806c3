"""Which transformers layers compute the Llama-family formulas, by class, so that a faster
implementation of the same formula (engine/rollout/static_decode.py's decode step,
engine/model/fused_kernels.py's training kernels) replaces only layers it is exact for."""

from __future__ import annotations

# x * rsqrt(mean(x^2) + eps), in float32, cast back to the input dtype, times weight
RMS_NORM_CLASSES = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
# down(act(gate(x)) * up(x))
GATED_MLP_CLASSES = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}
SILU_CLASSES = {"SiLUActivation", "SiLU"}


def is_llama_rms_norm(module) -> bool:
    return type(module).__name__ in RMS_NORM_CLASSES and getattr(module, "weight", None) is not None \
        and getattr(module, "variance_epsilon", None) is not None


def is_plain_gated_mlp(mlp) -> bool:
    """The MLP computes down(act(gate(x)) * up(x)) -- the Llama/Qwen/Mistral MLP classes."""
    return type(mlp).__name__ in GATED_MLP_CLASSES and \
        all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def is_silu_gated_mlp(mlp) -> bool:
    return is_plain_gated_mlp(mlp) and type(mlp.act_fn).__name__ in SILU_CLASSES
