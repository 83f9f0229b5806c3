"""Which model shapes Transformer-Engine's FP8 GEMMs take, checked before the model is built.

TE runs each Linear in FP8 only on a per-rank weight ``[out, in]`` with ``out % 8 == 0`` and
``in % 16 == 0`` (``transformer_engine.pytorch.utils.assert_dim_for_fp8_exec``, called on the
input and the weight at every FP8 forward). Otherwise the run dies at its first forward with an
assertion naming a tensor's dims and nothing else. Under tensor parallelism the per-rank shapes
are the model's divided by TP: a column-parallel layer splits ``out``, a row-parallel one ``in``.

The layers megatron's Transformer-Engine spec builds per block (a MoE block's experts have the
MLP's shapes with the expert MLP size; the router and the output layer are not TE layers):

======================  =====================================  ======================
layer                   out (per rank)                         in (per rank)
======================  =====================================  ======================
linear_qkv (column)     (heads + 2 kv_heads) * head_dim / tp   hidden
linear_proj (row)       hidden                                 heads * head_dim / tp
linear_fc1 (column)     2 * mlp / tp  (gate and up)            hidden
linear_fc2 (row)        hidden                                 mlp / tp
======================  =====================================  ======================

The input rows (tokens) are padded to a multiple TE takes elsewhere (the sequence padding)."""

from __future__ import annotations

from engine.errors import ConfigError


def fp8_weight_shapes(arch, tp: int) -> dict[str, tuple[int, int]]:
    """Each TE layer's per-rank weight ``(out, in)`` for ``arch`` at tensor-parallel size ``tp``."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    mlp = "experts' linear_fc" if arch.is_moe else "linear_fc"
    return {"linear_qkv": ((q + 2 * kv) // tp, arch.hidden_size),
            "linear_proj": (arch.hidden_size, q // tp),
            f"{mlp}1": (2 * arch.intermediate_size // tp, arch.hidden_size),
            f"{mlp}2": (arch.hidden_size, arch.intermediate_size // tp)}


def fp8_misfits(arch, tp: int) -> list[str]:
    """The layers whose per-rank weight FP8 cannot take, each as 'name [out, in]'."""
    return [f"{name} [{o}, {i}]" for name, (o, i) in fp8_weight_shapes(arch, tp).items() if o % 8 or i % 16]


def check_fp8_shapes(arch, tp: int) -> None:
    """Refuse ``engine.fp8=true`` for a model whose layers FP8 cannot run, naming them and the fix."""
    misfits = fp8_misfits(arch, tp)
    if not misfits:
        return
    fits = [t for t in range(1, arch.num_heads + 1) if not (arch.num_heads % t or arch.num_kv_heads % t
                                                            or arch.intermediate_size % t or fp8_misfits(arch, t))]
    sizes = (f" This model runs in FP8 with engine.tensor_model_parallel_size in {{{', '.join(map(str, fits))}}}."
             if fits else " No tensor-parallel size fixes that for this model.")
    raise ConfigError(
        f"engine.fp8=true: Transformer-Engine runs a layer in FP8 only when its per-rank weight [out, in] has out "
        f"divisible by 8 and in by 16, and at engine.tensor_model_parallel_size={tp} these do not: "
        f"{', '.join(misfits)} (hidden {arch.hidden_size}, MLP {arch.intermediate_size}, {arch.num_heads} heads and "
        f"{arch.num_kv_heads} key/value heads of {arch.head_dim}).{sizes} Or set engine.fp8=false.",
        title="invalid config value")
