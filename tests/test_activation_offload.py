"""Activation offload (engine/memory/activation_offload.py): tensors saved for backward by
matching modules go to host buffers and come back for backward. On a CPU host and device are
one memory, so what these tests protect is exactness (gradients bit-identical with and without
offload, through FSDP2 at 1 and 2 ranks and megatron-core, with and without gradient
checkpointing), what is and is not offloaded, the host limit and the pattern errors. The copies
on a side CUDA stream are checked on a GPU by bench/gpu_check_activation_offload.sh."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config.load import load_run_config
from engine.config.schema import ModelConfig
from engine.errors import ConfigError
from engine.memory.activation_offload import (ActivationOffloader, make_activation_offloader, matching_modules,
                                              use_reentrant_checkpointing)
from engine.model.grad_checkpointing import enable_checkpointing
from tests.dist_utils import run_ranks

VOCAB, PAD, EOS = 16, 0, 1


def _tiny_hf(seed=0):
    from engine.model.build import build_hf_model

    torch.manual_seed(seed)
    return build_hf_model(ModelConfig(num_layers=3), "", VOCAB, seed, PAD, EOS).float().train()


def _grads(model, ids):
    out = model(input_ids=ids, use_cache=False).logits
    out.float().log_softmax(-1).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _ids(rows=4, t=12, seed=1):
    return torch.randint(2, VOCAB, (rows, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_gradients_are_bit_identical_with_offload(checkpointing):
    base = _tiny_hf()
    off_model = copy.deepcopy(base)
    if checkpointing:
        enable_checkpointing(base)                  # transformers' default (non-reentrant)
        use_reentrant_checkpointing(off_model)      # what the engines use with offload
    ids = _ids()
    want = _grads(base, ids)
    off = ActivationOffloader(off_model, ["model.layers.*"], 1 << 30).attach()
    got = _grads(off_model, ids)
    st = off.end_micro_batch()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert st.tensors_offloaded > 0 and st.kept_bytes == 0
    # every module but the first in forward order is prefetched by the backward of the next one
    assert st.prefetched + st.fetched_on_demand == st.tensors_offloaded and st.prefetched > 0
    if checkpointing:  # only what checkpointing keeps: each layer's input hidden states
        hidden = ids.numel() * base.config.hidden_size * 4
        assert st.tensors_offloaded == 3 and st.host_bytes == 3 * hidden


def test_backward_lets_go_of_each_restored_copy_once_its_node_has_it():
    """The offloader hands a restored copy to autograd and drops its own reference, so a copy lives
    only as long as backward needs it. Held until the micro-batch ends (as before 2026-12-06), every
    restored activation was back on the GPU by the end of backward: offload then lowered no peak."""
    import gc
    import weakref

    model = _tiny_hf()
    off = ActivationOffloader(model, ["model.layers.*"], 1 << 30).attach()
    restored = []
    fetch = off._fetch

    def recording_fetch(saved):
        fetch(saved)
        restored.append(weakref.ref(saved.prefetched))

    off._fetch = recording_fetch
    _grads(model, _ids())
    gc.collect()
    assert restored, "backward restored nothing"
    alive = sum(r() is not None for r in restored)
    assert alive == 0, f"{alive} of {len(restored)} restored activations still held after backward"
    off.end_micro_batch()


def test_a_tensor_several_ops_save_is_copied_once():
    """Three projections reading one input each save it; without offload they share its storage,
    so offload keeps one host copy and restores it once, for all three."""
    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Projections()

        def forward(self, x):
            return self.inner(torch.tanh(x)).square().sum()

    torch.manual_seed(0)
    base, x = Net(), torch.randn(4, 8)
    off_net = copy.deepcopy(base)
    base(x).backward()
    off = ActivationOffloader(off_net, ["inner"], 1 << 30).attach()
    off_net(x).backward()
    st = off.end_micro_batch()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(base.parameters(), off_net.parameters()))
    # tanh(x), saved by q, k and v, once; q(x) and k(x), saved by the product
    assert st.tensors_offloaded == 3 and st.host_bytes == 3 * 4 * 8 * 4
    assert st.prefetched + st.fetched_on_demand == 3


def test_parameters_and_outside_tensors_are_not_offloaded():
    model = _tiny_hf()
    off = ActivationOffloader(model, ["model.layers.1"], 1 << 30).attach()
    saved_in_layer = []
    orig = off._pack
    off._pack = lambda t: (saved_in_layer.append(t), orig(t))[1]  # read when the layer's forward starts
    _grads(model, _ids())
    st = off.end_micro_batch()
    params = {p.data_ptr() for p in model.parameters()}
    offloaded = [t for t in saved_in_layer if t.data_ptr() not in params]
    # each distinct tensor once (several ops saving one tensor share its copy)
    assert st.tensors_offloaded == len({id(t) for t in offloaded if not isinstance(t, torch.nn.Parameter)})
    assert 0 < st.tensors_offloaded < len(saved_in_layer)   # the layer's weights were saved too, not offloaded
    assert st.modules == ["model.layers.1"]


def test_no_offload_outside_training_forward():
    model = _tiny_hf()
    off = ActivationOffloader(model, ["model.layers.*"], 1 << 30).attach()
    with torch.no_grad():
        model(input_ids=_ids(), use_cache=False)
    assert off.end_micro_batch().tensors_offloaded == 0


def test_host_limit_keeps_the_rest_on_device_and_reuses_buffers():
    ids = _ids()
    base = _tiny_hf()
    want = _grads(copy.deepcopy(base), ids)
    full = ActivationOffloader(copy.deepcopy(base), ["model.layers.*"], 1 << 30)
    m_full = full.model
    full.attach()
    _grads(m_full, ids)
    need = full.end_micro_batch().host_bytes

    limited_model = copy.deepcopy(base)
    limit = need // 2
    off = ActivationOffloader(limited_model, ["model.layers.*"], limit).attach()
    got = _grads(limited_model, ids)
    st = off.end_micro_batch()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert st.kept_bytes > 0 and st.tensors_kept > 0 and 0 < st.host_bytes <= limit
    assert st.host_bytes + st.kept_bytes == need and off.pool.allocated <= limit
    # the next micro-batch reuses the pool: no new host memory
    for p in limited_model.parameters():
        p.grad = None
    _grads(limited_model, ids)
    st2 = off.end_micro_batch()
    assert off.pool.allocated == st.pool_bytes and st2.host_bytes == st.host_bytes

    tiny = ActivationOffloader(copy.deepcopy(base), ["model.layers.*"], 16).attach()
    _grads(tiny.model, ids)
    st3 = tiny.end_micro_batch()
    assert st3.tensors_offloaded == 0 and st3.kept_bytes == need


def test_a_new_micro_batch_shape_evicts_free_buffers_of_other_sizes():
    """Micro-batch shapes vary (token budgets, buckets): when the first shape's buffers fill the
    host limit, the next shape's tensors still go to host (free buffers of other sizes evicted),
    instead of all of them staying on the device for the rest of the run."""
    model = _tiny_hf()
    full = ActivationOffloader(copy.deepcopy(model), ["model.layers.*"], 1 << 30).attach()
    _grads(full.model, _ids(t=12))
    need = full.end_micro_batch().host_bytes
    off = ActivationOffloader(model, ["model.layers.*"], need).attach()
    _grads(model, _ids(t=12))
    assert off.end_micro_batch().tensors_kept == 0 and off.pool.allocated == need
    for p in model.parameters():
        p.grad = None
    want = _grads(copy.deepcopy(_tiny_hf()), _ids(t=11))
    got = _grads(model, _ids(t=11))   # every tensor a size the pool has no free buffer of
    st = off.end_micro_batch()
    assert st.tensors_kept == 0 and st.tensors_offloaded > 0 and off.pool.allocated <= need
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_restored_tensors_keep_the_layout_forward_saved():
    """A transposed activation comes back transposed (same strides), not made contiguous: backward
    kernels choose by layout, and a copy would only cost time."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(6, 6)

        def forward(self, x):
            h = self.inner(x).transpose(0, 1)   # [6, 4] view of a [4, 6] tensor
            return (h.sin() * h).sum()

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(0)
    model, x = Outer(), torch.randn(4, 6)
    off = ActivationOffloader(model, ["net"], 1 << 30).attach()
    packed, unpacked = [], []
    pack, unpack = off._pack, off._unpack
    off._pack = lambda t: (packed.append((tuple(t.shape), t.stride())), pack(t))[1]
    off._unpack = lambda s: (lambda t: (unpacked.append((tuple(t.shape), t.stride())), t)[1])(unpack(s))
    model(x).backward()
    off.end_micro_batch()
    transposed = ((6, 4), (1, 6))
    assert transposed in packed and transposed in unpacked
    assert set(unpacked) <= set(packed)


def test_a_module_matched_alone_still_prefetches_within_itself():
    """Megatron's whole decoder under full recompute is one matched module: with no module before
    it, backward's prefetch reads its tensors one ahead, in the reverse of the order they were saved."""
    model = _tiny_hf()
    base = copy.deepcopy(model)
    ids = _ids()
    want = _grads(base, ids)
    off = ActivationOffloader(model, ["model"], 1 << 30).attach()
    got = _grads(model, ids)
    st = off.end_micro_batch()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert st.prefetched > st.tensors_offloaded // 2 and st.prefetched + st.fetched_on_demand == st.tensors_offloaded


def test_patterns_match_outermost_modules_only_and_no_match_is_a_config_error():
    model = _tiny_hf()
    names = [n for n, _ in matching_modules(model, ["model.layers.*", "model.layers.*.mlp"])]
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    cfg = load_run_config(["engine.activation_offload=true", "engine.activation_offload_modules=[decoder.blocks.*]"])
    with pytest.raises(ConfigError, match="matches no module.*model.layers"):
        make_activation_offloader(model, cfg.config.engine, [], torch.device("cpu"))
    off_cfg = load_run_config([]).config.engine
    assert make_activation_offloader(model, off_cfg, ["model.layers.*"], torch.device("cpu")) is None


def test_config_keys_validate():
    with pytest.raises(ConfigError, match="activation_offload_host_cache_limit_gb"):
        load_run_config(["engine.activation_offload_host_cache_limit_gb=-1"])
    cfg = load_run_config(["engine.activation_offload=true"]).config.engine
    assert cfg.activation_offload and cfg.activation_offload_modules == []


# ---- through the engines ----------------------------------------------------------------------
def _batch():
    from engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(0)
    B, T = 8, 10
    ids = torch.randint(2, VOCAB, (B, T), generator=g)
    lengths = torch.tensor([10, 7, 9, 5, 10, 6, 8, 4])
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    resp = attn.float().clone()
    resp[:, :2] = 0
    adv = torch.randn(B, generator=g)[:, None] * resp
    return SequenceBatch(input_ids=ids * attn, attention_mask=attn, response_mask=resp,
                         prompt_lengths=torch.full((B,), 2), advantages=adv)


def _step(engine_cls, cfg, rank, world):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.trainer.worker_group import shard_slices

    eng = engine_cls(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    batch = _batch()
    eng.train_step(batch.select(shard_slices(len(batch), world)[rank]), PolicyLoss(cfg.algorithm, world))
    st = getattr(eng, "activation_stats", None)
    return ({k: v.clone() for k, v in eng.export_hf_state_dict().items()},
            None if st is None else st.to_json())


def _plain_and_offloaded(rank, world, engine):
    """One optimizer step from the same seed without and with activation offload, for gradient
    checkpointing off and on: {checkpointing: [plain, offloaded]}, all four in one process."""
    if engine == "megatron":
        from engine.backends.megatron.engine import MegatronEngine as cls
    else:
        from engine.backends.fsdp import FSDPEngine as cls
    out = {}
    for checkpointing in ("false", "true"):
        base = [f"engine={engine}", "engine.micro_batch_size=2", f"engine.gradient_checkpointing={checkpointing}",
                "model.num_layers=2"]
        out[checkpointing] = [_step(cls, load_run_config(base + extra).config, rank, world)
                              for extra in ([], ["engine.activation_offload=true"])]
    return out


def _assert_identical(results):
    for (want, none), (got, st) in results:
        assert none is None and st is not None and st["tensors_offloaded"] > 0
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), max(
            float((want[k] - got[k]).abs().max()) for k in want)
    return [st for _, (_, st) in results]


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_step_is_bit_identical_with_activation_offload(world):
    """With and without gradient checkpointing (one spawn of the ranks for both)."""
    per_rank = run_ranks(_plain_and_offloaded, world, "fsdp")
    for checkpointing in ("false", "true"):
        stats = _assert_identical([r[checkpointing] for r in per_rank])
        assert all(st["modules"] == 2 for st in stats), checkpointing  # one per decoder layer (the default)


@pytest.mark.megatron
def test_megatron_tp1_step_is_bit_identical_with_activation_offload():
    pytest.importorskip("megatron.core")
    per_rank = run_ranks(_plain_and_offloaded, 1, "megatron")
    for checkpointing in ("false", "true"):
        stats = _assert_identical([r[checkpointing] for r in per_rank])
        # without recompute one module per layer; with full recompute the block whose checkpoint
        # keeps each layer's inputs
        assert stats[0]["modules"] == (1 if checkpointing == "true" else 2), checkpointing
