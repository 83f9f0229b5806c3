"""megatron's fused kernels are asked for only where they can be imported (issue 40: the local layer
spec on a GPU crashed at its first bf16 forward with ``ModuleNotFoundError: scaled_masked_softmax_cuda``,
because the masked-softmax fusion was on whenever the device was a GPU). The engine, the critic and
bench/gpu_check_megatron.sh all take the switches from ``fusion_choices``, and each fusion turned off
is said (the engine's notes, logged)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("megatron.core")

from engine.backends.megatron.model import FUSED_SOFTMAX_MODULES, fusion_choices, missing_fused_softmax_kernels


def test_cpu_fuses_nothing_and_says_nothing():
    fusions, notes = fusion_choices(on_gpu=False, use_te=False)
    assert not any(fusions.values()) and notes == []


def test_gpu_without_the_softmax_extension_runs_the_softmax_unfused_and_says_so():
    assert missing_fused_softmax_kernels() == list(FUSED_SOFTMAX_MODULES)  # none is built on this machine
    fusions, notes = fusion_choices(on_gpu=True, use_te=False)
    assert fusions == {"bias_activation_fusion": True, "masked_softmax_fusion": False, "bias_dropout_fusion": True}
    assert len(notes) == 1 and "scaled_masked_softmax_cuda" in notes[0] and "unfused" in notes[0]


def test_transformer_engine_spec_keeps_its_own_fused_softmax():
    fusions, notes = fusion_choices(on_gpu=True, use_te=True)
    assert fusions["masked_softmax_fusion"] and notes == []


def test_importable_extensions_are_used(tmp_path, monkeypatch):
    """Real modules of those names on sys.path (as a built apex provides them): the fusion stays on."""
    for name in FUSED_SOFTMAX_MODULES:
        (tmp_path / f"{name}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in FUSED_SOFTMAX_MODULES:
        sys.modules.pop(name, None)
    assert missing_fused_softmax_kernels() == []
    fusions, notes = fusion_choices(on_gpu=True, use_te=False)
    assert fusions["masked_softmax_fusion"] and notes == []


def test_the_transformer_config_carries_the_choice():
    import torch

    from engine.backends.megatron.model import Arch, transformer_config

    arch = Arch(model_type="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False)
    fusions, _ = fusion_choices(on_gpu=True, use_te=False)
    tcfg = transformer_config(arch, dtype=torch.bfloat16, tp=1, on_gpu=True, fusions=fusions)
    assert tcfg.masked_softmax_fusion is False and tcfg.bias_activation_fusion is True
