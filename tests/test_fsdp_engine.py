"""The FSDP2 engine: rollout log-probs match the engine's recompute, and a two-rank step
equals a single-rank step on the same global batch."""

from __future__ import annotations

import pytest
import torch

from engine.config.load import load_run_config
from tests.dist_utils import run_ranks

VOCAB, PAD, EOS = 12, 0, 1


def _engine(overrides):
    from engine.backends.fsdp import FSDPEngine

    cfg = load_run_config(overrides).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    return cfg, eng


def _rollout_vs_recompute(rank, world):
    from engine.rollout.torch_sampler import TorchSampler

    cfg, eng = _engine(["rollout.temperature=0.7", "rollout.max_new_tokens=9", "engine.micro_batch_size=5"])
    sampler = TorchSampler(cfg.rollout, PAD, EOS, eng.device)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [2]]
    with eng.generation_model() as m:
        batch = sampler.generate(m, prompts, 4, torch.Generator().manual_seed(rank))
    recomputed, _ = eng.compute_log_probs(batch)
    mask = batch.response_mask
    return (batch.rollout_log_probs * mask, recomputed * mask, int(mask.sum()))


def test_rollout_log_probs_equal_engine_recompute():
    """What the KV-cache sampler reports as log p(token) equals the engine's full forward
    (left-padded incremental decoding vs right-padded micro-batched recompute), on 2 ranks."""
    for sampled, recomputed, n in run_ranks(_rollout_vs_recompute, 2):
        assert n > 0
        assert torch.allclose(sampled, recomputed, atol=1e-5), (sampled - recomputed).abs().max()


def _one_step(rank, world, batch, micro):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.trainer.worker_group import shard_slices

    cfg, eng = _engine([f"engine.micro_batch_size={micro}", "algorithm.entropy_coef=0.01",
                        "algorithm.loss_agg_mode=seq-mean-token-mean"])
    shard = batch.select(shard_slices(len(batch), world)[rank])
    stats = eng.train_step(shard, PolicyLoss(cfg.algorithm, world))
    full = eng.export_hf_state_dict()
    return {k: v.clone() for k, v in full.items()}, stats.metrics


def _batch():
    from engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(0)
    B, T = 8, 10
    ids = torch.randint(2, VOCAB, (B, T), generator=g)
    lengths = torch.tensor([10, 7, 9, 5, 10, 6, 8, 4])
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    resp = attn.float().clone()
    resp[:, :2] = 0
    ids = ids * attn
    adv = torch.randn(B, generator=g)[:, None] * resp
    return SequenceBatch(input_ids=ids, attention_mask=attn, response_mask=resp,
                         prompt_lengths=torch.full((B,), 2), advantages=adv)


def test_two_rank_step_equals_one_rank_step():
    """Data parallelism changes nothing: the parameters after one optimizer step on 2 ranks
    (each with half the batch, different micro-batching) equal those from 1 rank. Tolerance
    2e-5 absolute = 0.4% of one AdamW step at lr 5e-3 (measured: 2e-6, fp32 reduction order)."""
    batch = _batch()
    (one, m1), = run_ranks(_one_step, 1, batch, 3)
    two = run_ranks(_one_step, 2, batch, 2)
    params2 = two[0][0]
    assert one.keys() == params2.keys()
    worst = max((one[k] - params2[k]).abs().max().item() for k in one)
    assert worst < 2e-5, worst
    pg2 = sum(r[1]["pg_loss"] for r in two)
    assert abs(m1["pg_loss"] - pg2) < 1e-5


def test_the_pad_tokens_embedding_trains_when_the_policy_samples_it():
    """A sampled pad token is a real response token: its embedding row gets its gradient (as in
    megatron's embedding), while padding positions, masked out, contribute none."""
    from engine.config.schema import ModelConfig
    from engine.model.build import build_hf_model

    model = build_hf_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64), "", 12, seed=0,
                           pad_token_id=0, eos_token_id=1)
    assert model.get_input_embeddings().padding_idx is None
    ids = torch.tensor([[3, 4, 0, 5, 0], [6, 7, 8, 0, 0]])      # row 0 samples pad at position 2
    attn = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])     # trailing pads are padding
    logits = model(input_ids=ids, attention_mask=attn).logits
    (logits[0, 3].logsumexp(-1) - logits[0, 3, 5]).backward()  # a loss on the token after the sampled pad
    assert model.get_input_embeddings().weight.grad[0].abs().sum() > 0
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits
    (logits[1, 2].logsumexp(-1) - logits[1, 2, 8]).backward()  # only real tokens before it, pads after
    assert model.get_input_embeddings().weight.grad[0].abs().sum() == 0


def test_compiled_blocks_train_like_eager():
    """engine.compile=true compiles each decoder block's forward under FSDP2 (its hooks stay
    eager around the block): two update steps give the eager engine's losses and weights to
    float tolerance, and generation (a new shape every token) runs on the eager forwards. A
    compiled root forward used to bypass the root's hooks and fail on sharded weights."""
    results = run_ranks(_compiled_vs_eager, 1)[0]
    for (eager_loss, eager_w), (comp_loss, comp_w) in zip(results["eager"], results["compiled"]):
        assert abs(eager_loss - comp_loss) < 1e-5, (eager_loss, comp_loss)
        assert torch.allclose(eager_w, comp_w, atol=1e-5)
    assert results["compiled_blocks"] == 2
    assert results["eager_while_generating"] and not results["eager_after"]


def grpo_steps(cfg, eng, world, n_steps: int = 2, while_generating=None) -> list:
    """``n_steps`` GRPO steps on two fixed prompt groups (4 samples each, seeded rollouts):
    [(pg_loss, a copy of layer 0's down_proj weight)] after each. ``while_generating()`` runs
    inside each rollout's generation_model."""
    from engine.algorithms.advantages import grpo_advantages, token_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.rollout.torch_sampler import TorchSampler

    sampler = TorchSampler(cfg.rollout, PAD, EOS, eng.device)
    steps = []
    for i in range(n_steps):
        with eng.generation_model() as m:
            if while_generating is not None:
                while_generating()
            batch = sampler.generate(m, [[3, 4, 5], [6, 7]], 4, torch.Generator().manual_seed(i))
        rewards = torch.arange(len(batch), dtype=torch.float32) % 3
        batch.advantages = token_advantages(grpo_advantages(rewards, 4), batch.response_mask)
        stats = eng.train_step(batch, PolicyLoss(cfg.algorithm, world))
        w = eng.export_hf_state_dict()["model.layers.0.mlp.down_proj.weight"]
        steps.append((stats.metrics["pg_loss"], w.clone()))
    return steps


def _compiled_vs_eager(rank, world):
    from engine.backends.fsdp import decoder_blocks

    out = {}
    for name, extra in (("eager", []), ("compiled", ["engine.compile=true"])):
        torch.manual_seed(0)
        cfg, eng = _engine(["engine.micro_batch_size=16", "optim.lr=1e-2", *extra])
        blocks = decoder_blocks(eng.model)

        def check():
            if extra:
                out["eager_while_generating"] = all(b.forward == b._rl_eager_forward for b in blocks)

        out[name] = grpo_steps(cfg, eng, world, while_generating=check)
        if extra:
            out["compiled_blocks"] = sum(hasattr(b, "_rl_eager_forward") for b in blocks)
            out["eager_after"] = any(b.forward == b._rl_eager_forward for b in blocks)
    return out


def test_fsdp_unit_auto_is_no_fsdp_on_a_one_rank_cpu_run():
    """engine.fsdp_unit=auto: no FSDP2 on one CPU rank (its gather copies, hooks and DTensor
    dispatch cost ~20% of an update there and shard nothing), a unit per decoder layer on more
    ranks or a GPU; the explicit choices are kept."""
    from engine.backends.fsdp import fsdp_units
    from engine.config.schema import FSDPEngineConfig

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    auto, layer, model, none = (FSDPEngineConfig(fsdp_unit=u) for u in ("auto", "layer", "model", "none"))
    assert fsdp_units(auto, 1, cpu) == "none"
    assert fsdp_units(auto, 2, cpu) == fsdp_units(auto, 1, gpu) == "layer"
    assert fsdp_units(layer, 1, cpu) == "layer" and fsdp_units(model, 4, gpu) == "model"
    assert fsdp_units(none, 1, cpu) == "none"
    assert fsdp_units(auto, 1, cpu, "bfloat16") == "model"  # its compute copy is FSDP2's mixed precision


def test_fsdp_unit_none_refuses_more_ranks_and_low_precision():
    """engine.fsdp_unit=none is the plain model on one rank: more ranks need FSDP2 to shard over,
    and a bf16 model needs its mixed-precision policy; each gets a ConfigError naming the fix."""
    from engine.backends.fsdp import check_fsdp_units
    from engine.errors import ConfigError

    check_fsdp_units("none", 1, "float32")
    check_fsdp_units("layer", 4, "bfloat16")
    with pytest.raises(ConfigError, match="2 ranks.*engine.fsdp_unit=auto"):
        check_fsdp_units("none", 2, "float32")
    with pytest.raises(ConfigError, match="model.dtype=bfloat16.*model.dtype=float32"):
        check_fsdp_units("none", 1, "bfloat16")


def test_one_unit_trains_bit_for_bit_like_a_unit_per_layer():
    """On one rank the whole-model unit, per-layer units and no FSDP2 at all compute the same
    update: after two steps every weight and the optimizer state are equal bit for bit, and the
    checkpoint state has the same keys and shapes (the two FSDP2 layouts the same DTensor
    placements too; a checkpoint of any loads into the others: test_resume's world-size
    changes load a plain one-rank checkpoint into FSDP2 ranks and back)."""
    results = run_ranks(_units_compared, 1)[0]
    assert results["layer_units"] == results["layers"] + 1 >= 3 and results["model_units"] == 1
    assert results["none_units"] == 0 and results["none_plain"]
    for other in ("model", "none"):
        assert results[f"{other}_same_weights"] and results[f"{other}_same_optim"], other
        assert results[f"{other}_same_layout"], other


def _units_compared(rank, world):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from engine.backends.fsdp import decoder_blocks

    out, states = {}, {}
    for unit in ("layer", "model", "none"):
        torch.manual_seed(0)
        cfg, eng = _engine(["engine.micro_batch_size=4", "optim.lr=1e-2", f"engine.fsdp_unit={unit}"])
        out[f"{unit}_units"] = sum(isinstance(m, FSDPModule) for m in eng.model.modules())
        out["layers"] = len(decoder_blocks(eng.model))
        if unit == "none":
            out["none_plain"] = not any(isinstance(p, DTensor) for p in eng.model.parameters())
        grpo_steps(cfg, eng, world)
        states[unit] = eng.checkpoint_state()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    a = states["layer"]
    for other in ("model", "none"):
        b = states[other]
        out[f"{other}_same_weights"] = a["model"].keys() == b["model"].keys() and all(
            torch.equal(local(a["model"][k]), local(b["model"][k])) for k in a["model"])
        out[f"{other}_same_optim"] = a["optim"].keys() == b["optim"].keys() and all(
            torch.equal(local(a["optim"][k]), local(b["optim"][k])) if isinstance(a["optim"][k], torch.Tensor)
            else a["optim"][k] == b["optim"][k] for k in a["optim"])
        out[f"{other}_same_layout"] = all(
            tuple(a["model"][k].shape) == tuple(b["model"][k].shape)
            and (other == "none" or getattr(a["model"][k], "placements", None) == getattr(b["model"][k], "placements", None))
            for k in a["model"])
    return out


def test_on_a_gpu_host_tensors_have_a_backend_too():
    """The ranks agree on host-side counts (micro-batches, token totals, rows to skip) with
    collectives on CPU tensors (engine/backends/base.py, fsdp/engine.py). An NCCL-only group
    refuses those on every multi-GPU run, so on CUDA the group is NCCL for CUDA tensors and gloo
    for host ones; on CPU, gloo."""
    import torch
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from engine.device import dist_backend

    assert BackendConfig(Backend(dist_backend(torch.device("cuda", 0)))).get_device_backend_map() == \
        {"cpu": "gloo", "cuda": "nccl"}
    assert dist_backend(torch.device("cpu")) == "gloo"


def test_a_rank_computes_on_the_gpu_ray_assigned_it():
    """Ray sets CUDA_VISIBLE_DEVICES to a rank's one GPU (cuda:0 inside it). Where a cluster tells
    Ray not to (every GPU visible), rank % device_count picks some GPU, possibly another rank's;
    the assigned id's position among the visible devices is the right one."""
    from engine.device import assigned_cuda_index

    assert assigned_cuda_index(["5"], "5", fallback=3) == 0                 # Ray's default: only it visible
    assert assigned_cuda_index(["5"], "0,1,2,3,4,5,6,7", fallback=3) == 5   # every GPU visible
    assert assigned_cuda_index(["5"], "4,5", fallback=3) == 1
    assert assigned_cuda_index(["5"], None, fallback=3) == 5                # nothing restricts: physical ids
    assert assigned_cuda_index([], "0,1", fallback=3) == 3                  # no GPU from Ray: as before
    assert assigned_cuda_index(["GPU-uuid-1"], "GPU-uuid-0,GPU-uuid-1", fallback=0) == 1


def test_on_a_gpu_each_micro_batch_reduce_scatters_its_gradients(monkeypatch):
    """With gradient sync off until the last micro-batch, FSDP2 keeps every unit's whole fp32
    gradient on each GPU through the accumulation (the memory estimate counts shards): on CUDA every
    micro-batch reduce-scatters; on a CPU (host memory, slower gloo collectives) the last one only."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import engine.backends.fsdp.engine as fsdp_engine

    synced = []
    monkeypatch.setattr(fsdp_engine, "set_gradient_sync", lambda model, sync: synced.append(sync))
    for device in ("cuda", "cpu"):
        rank = SimpleNamespace(device=torch.device(device), _replay=lambda *a, **k: nullcontext())
        for last in (False, True):
            fsdp_engine.FSDPEngine._backward_scope(rank, None, None, None, last)
    assert synced == [True, True, False, True]
