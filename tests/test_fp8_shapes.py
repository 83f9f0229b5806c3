"""engine.fp8=true on megatron: a model whose per-rank layer weights Transformer-Engine's FP8 GEMMs
cannot take (out % 8, in % 16: TE's assert_dim_for_fp8_exec) is refused before the model is built,
naming the layers, their shapes and the tensor-parallel sizes that work, instead of an assertion at
the first forward on a GPU. The shapes are worked out by hand here; tests/test_megatron.py checks
them against the layers megatron builds."""

from __future__ import annotations

import pytest

from engine.backends.megatron.model import Arch
from engine.errors import ConfigError


def _arch(hidden=128, mlp=320, heads=16, kv_heads=8, head_dim=8, experts=0):
    return Arch(model_type="llama", vocab_size=1000, hidden_size=hidden, intermediate_size=mlp, num_layers=2,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False, num_experts=experts,
                moe_top_k=2 if experts else 0)


def test_per_rank_weight_shapes_by_hand():
    from engine.backends.megatron.fp8_shapes import fp8_weight_shapes

    # q = 16 heads x 8 = 128, kv = 8 x 8 = 64: qkv out 128 + 2 x 64 = 256; gate+up 2 x 320 = 640
    assert fp8_weight_shapes(_arch(), 1) == {"linear_qkv": (256, 128), "linear_proj": (128, 128),
                                             "linear_fc1": (640, 128), "linear_fc2": (128, 320)}
    assert fp8_weight_shapes(_arch(), 4) == {"linear_qkv": (64, 128), "linear_proj": (128, 32),
                                             "linear_fc1": (160, 128), "linear_fc2": (128, 80)}
    assert set(fp8_weight_shapes(_arch(experts=4), 1)) == {"linear_qkv", "linear_proj", "experts' linear_fc1",
                                                           "experts' linear_fc2"}


def test_shapes_fp8_takes_pass_and_others_are_refused_with_the_sizes_that_work():
    from engine.backends.megatron.fp8_shapes import check_fp8_shapes, fp8_misfits

    for tp in (1, 2, 4):
        check_fp8_shapes(_arch(), tp)  # MLP 320 / 4 = 80, a multiple of 16
    # at TP 8 the MLP's row-parallel shard is 320 / 8 = 40 wide: not a multiple of 16
    assert fp8_misfits(_arch(), 8) == ["linear_fc2 [128, 40]"]
    with pytest.raises(ConfigError) as e:
        check_fp8_shapes(_arch(), 8)
    msg = str(e.value)
    assert "linear_fc2 [128, 40]" in msg and "tensor_model_parallel_size=8" in msg
    assert "in {1, 2, 4}" in msg and "engine.fp8=false" in msg
    # hidden 100: every layer reads or writes it, no TP size helps
    assert fp8_misfits(_arch(hidden=100), 1) == ["linear_qkv [256, 100]", "linear_proj [100, 128]",
                                                 "linear_fc1 [640, 100]", "linear_fc2 [100, 320]"]
    with pytest.raises(ConfigError, match="No tensor-parallel size fixes that"):
        check_fp8_shapes(_arch(hidden=100), 1)
    # out % 8: 5 heads + 2 x 1 kv head of 8 = 56 rows at TP 1 (fits); a head_dim of 4 gives 28 (does not)
    assert fp8_misfits(_arch(hidden=128, heads=5, kv_heads=1, head_dim=8), 1) == ["linear_proj [128, 40]"]
    assert "linear_qkv [28, 128]" in fp8_misfits(_arch(heads=5, kv_heads=1, head_dim=4), 1)
