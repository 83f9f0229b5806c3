"""PPO's critic on the megatron engine (engine/backends/megatron/critic.py), on CPU over gloo
with real megatron-core: one 2-rank session (torch.multiprocessing spawn) records what it
measured, the tests assert on it.

* TP=2: the critic's values equal the FSDP2 critic's model (engine.backends.critic.ValueModel:
  the same HF backbone plus the same value head) on the same weights; one critic step equals
  that model stepped by the clipped value loss and torch AdamW with the critic's settings; its
  checkpoint entries carry the FSDP2 critic's names; a param/optimizer offload round trip (the
  real storage moves, CPU standing in for the device) moves the critic and leaves it unchanged.
* TP=1 / DP=2: the TP=2 checkpoint loads bit-exactly and the next step (batch split over the two
  DP ranks) equals the TP=2 one.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron

TOL = 1e-5


def _cfg(tp: int):
    from test_megatron import _run_cfg

    cfg = _run_cfg(tp)
    cfg.algorithm.name = "ppo"
    cfg.critic.lr, cfg.critic.grad_clip, cfg.critic.cliprange_value = 1e-3, 1.0, 0.2
    return cfg


def _ppo_batch(seed: int):
    from test_megatron import _batch

    b = _batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    b.values = torch.randn(b.input_ids.shape, generator=g) * 0.1 * b.response_mask
    b.returns = torch.rand(b.input_ids.shape, generator=g) * b.response_mask
    return b


def _set_head(critic) -> None:
    """A non-zero value head, so values depend on the backbone (it starts at zero)."""
    head = critic.model.module.output_layer
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
        head.bias.fill_(0.1)


def _reference(cfg, head):
    """The FSDP2 critic's model (ValueModel) on the same initial backbone, with ``head``."""
    from test_megatron import VOCAB

    from engine.backends.fsdp.critic import ValueModel
    from engine.model.build import build_hf_model

    lm = build_hf_model(cfg.model, "", VOCAB, cfg.trainer.seed, 0, 1).float()
    vm = ValueModel(lm.base_model, lm.config.hidden_size)
    with torch.no_grad():
        vm.value_head.weight.copy_(head.weight)
        vm.value_head.bias.copy_(head.bias)
    return vm


def _reference_step(cfg, vm, batch) -> dict:
    from engine.algorithms.value_loss import value_loss
    from engine.backends.megatron.critic import critic_optim_config
    from engine.backends.schedule import build_optimizer

    opt, _ = build_optimizer(list(vm.parameters()), critic_optim_config(cfg), 1)
    v = vm(batch.input_ids, batch.attention_mask)
    loss, _ = value_loss(v, batch.values, batch.returns, batch.response_mask, cfg.critic.cliprange_value,
                         float(batch.response_mask.sum()))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(vm.parameters(), cfg.critic.grad_clip)
    opt.step()
    return {k: v.detach().clone() for k, v in vm.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _with_critic(cfg, world):
    from test_megatron import _engine

    from engine.backends.megatron.critic import MegatronCritic

    eng = _engine(cfg, world)
    eng.critic = MegatronCritic(cfg, eng)
    return eng


def _simulated_offload():
    """Run the engines' real offload helpers with CPU storages treated as device memory."""
    import functools

    import engine.memory.offload as off

    off.offload_params = functools.partial(off.offload_params, simulate_on_cpu=True)
    off.offload_optimizer_state = functools.partial(off.offload_optimizer_state, simulate_on_cpu=True)


def _session(rank: int, world: int, store: str, workdir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from test_megatron import _init

    _init(rank, world, store)
    rec: dict = {}
    # ---- TP=2 ----
    cfg = _cfg(tp=2)
    eng = _with_critic(cfg, world)
    critic = eng.critic
    _set_head(critic)
    vm = _reference(cfg, critic.model.module.output_layer)
    batch = _ppo_batch(0)
    vals = critic.compute_values(batch)
    with torch.no_grad():
        ref_vals = vm(batch.input_ids, batch.attention_mask) * batch.response_mask
    rec["values_err"] = float((vals - ref_vals).abs().max())
    rec["values_spread"] = float(ref_vals.std())
    rec["values_zero_outside_response"] = bool((vals * (1 - batch.response_mask)).abs().sum() == 0)
    rec["fsdp_names"] = set(critic.checkpoint_state()["model"]) == set(vm.state_dict())

    before = {k: v.detach().clone() for k, v in vm.state_dict().items()}
    out = critic.train_step(batch)
    ref_after = _reference_step(cfg, vm, batch)
    state = eng.checkpoint_state()
    rec["step_err"] = _max_diff(state["critic"]["model"], ref_after)
    rec["step_moved"] = _max_diff(ref_after, before)
    rec["metrics"] = out
    rec["critic_optim_keys"] = sorted({k.split(".")[-1] for k in state["critic"]["optim"] if k.startswith("state.")})
    dcp.save(state, checkpoint_id=os.path.join(workdir, "ckpt_tp2"))
    critic.train_step(_ppo_batch(1))
    after2 = critic.checkpoint_state()["model"]

    # offload round trip with the critic inside the engine's offload
    cfg.engine.param_offload = cfg.engine.optimizer_offload = True
    _simulated_offload()
    head_w = critic.model.module.output_layer.weight
    optim_before = {k: v.clone() for k, v in critic.checkpoint_state()["optim"].items() if isinstance(v, torch.Tensor)}
    rep = eng.offload()
    rec["offload_moved_critic_params"] = head_w.untyped_storage().size() == 0
    rec["offload_moved_critic_optim"] = all(t.untyped_storage().size() == 0
                                            for st in critic.optimizer.state.values() for t in st.values()
                                            if isinstance(t, torch.Tensor) and t.dim() > 0)
    rec["offload_bytes"] = (rep.param_bytes, rep.optimizer_bytes)
    eng.onload()
    rec["offload_round_trip_exact"] = _max_diff(critic.checkpoint_state()["model"], after2) == 0.0
    optim_after = {k: v for k, v in critic.checkpoint_state()["optim"].items() if isinstance(v, torch.Tensor)}
    rec["offload_optim_exact"] = _max_diff(optim_after, optim_before) == 0.0
    rec["critic_bytes"] = sum(p.numel() * p.element_size() for p in critic.model.parameters())
    if rank == 0:
        torch.save({"rec": rec, "after1": state["critic"]["model"], "after2": after2},
                   os.path.join(workdir, "critic_tp2.pt"))
    dist.barrier()

    # ---- TP=1 / DP=2: resume the TP=2 checkpoint, take the second step split over DP ----
    tp2 = torch.load(os.path.join(workdir, "critic_tp2.pt"), weights_only=False)
    cfg1 = _cfg(tp=1)
    eng1 = _with_critic(cfg1, world)
    state = eng1.checkpoint_state()
    dcp.load(state, checkpoint_id=os.path.join(workdir, "ckpt_tp2"))
    eng1.load_checkpoint_state(state)
    rec1 = {"load_exact": _max_diff(eng1.critic.checkpoint_state()["model"], tp2["after1"]) == 0.0,
            "dp": (eng1.dp_rank, eng1.dp_size)}
    second = _ppo_batch(1)
    eng1.critic.train_step(second.select(list(range(rank * 3, rank * 3 + 3))))
    rec1["resume_step_err"] = _max_diff(eng1.critic.checkpoint_state()["model"], tp2["after2"])
    if rank == 0:
        torch.save(rec1, os.path.join(workdir, "critic_tp1.pt"))
    from dist_utils import exit_after_barrier

    exit_after_barrier()   # skip the gloo teardown that intermittently aborts on this torch build


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from tests.dist_utils import start_ranks

    workdir = str(tmp_path_factory.mktemp("megatron_critic"))
    sys.path.insert(0, os.path.dirname(__file__))
    start_ranks(_session, (2, os.path.join(workdir, "store"), workdir), 2)
    tp2 = torch.load(os.path.join(workdir, "critic_tp2.pt"), weights_only=False)["rec"]
    tp1 = torch.load(os.path.join(workdir, "critic_tp1.pt"), weights_only=False)
    print(f"\nmegatron critic measured: tp2={tp2} tp1={tp1}")
    return {"tp2": tp2, "tp1": tp1}


def test_values_match_the_fsdp_critics_model_at_tp2(session):
    r = session["tp2"]
    assert r["values_spread"] > 1e-3          # the head is non-zero: values depend on the backbone
    assert r["values_err"] < TOL
    assert r["values_zero_outside_response"]


def test_one_critic_step_equals_the_value_loss_and_adamw_by_hand_at_tp2(session):
    r = session["tp2"]
    assert r["step_moved"] > 50 * TOL and r["step_err"] < TOL
    m = r["metrics"]
    assert m["metrics"]["value_loss"] > 0 and m["replicated"]["value_grad_norm"] > 0


def test_checkpoint_entries_carry_the_fsdp_critics_names(session):
    r = session["tp2"]
    assert r["fsdp_names"]
    assert r["critic_optim_keys"] == ["exp_avg", "exp_avg_sq", "step"]


def test_the_critic_follows_param_and_optimizer_offload(session):
    r = session["tp2"]
    assert r["offload_moved_critic_params"] and r["offload_moved_critic_optim"]
    assert r["offload_bytes"][0] >= r["critic_bytes"]
    assert r["offload_round_trip_exact"] and r["offload_optim_exact"]


def test_tp2_checkpoint_resumes_at_tp1_dp2(session):
    r = session["tp1"]
    assert r["dp"][1] == 2
    assert r["load_exact"]
    assert r["resume_step_err"] < TOL


def _sp_head_grads(rank: int, world: int):
    """ValueHead under sequence parallelism on ``world`` gloo ranks (the world as the TP group):
    each rank holds its slice of the sequence, the head and the loss are the same on every rank."""
    import torch.distributed as dist

    from engine.backends.megatron import cpu_shim
    from engine.backends.megatron.critic import ValueHead

    cpu_shim.apply()  # megatron's gather allocates on torch.cuda.current_device()
    s, b, h = 4 * world, 2, 8
    g = torch.Generator().manual_seed(3)
    full = torch.randn(s, b, h, generator=g)
    w = torch.randn(s, b, 1, generator=g)
    head = ValueHead(h, sequence_parallel=True, tp_group=dist.group.WORLD)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, h, generator=g))
    mine = full[rank * 4:(rank + 1) * 4].clone().requires_grad_(True)
    values, _ = head(mine)
    (values * w).sum().backward()
    return mine.grad, head.weight.grad, full, w, head.weight.detach().clone()


def test_sequence_parallel_value_head_gives_each_rank_its_slice_of_the_gradient():
    """Under sequence parallelism (megatron with Transformer-Engine, TP > 1: GPUs only) the value
    head gathers the sequence and then computes the same values on every TP rank. The backbone's
    gradient must be each rank's slice of d loss / d hidden; megatron's gather by default
    reduce-scatters it (right after a tensor-parallel layer, whose ranks hold partial gradients),
    which here summed TP equal copies: tp_size times the gradient into the whole backbone."""
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_utils import run_ranks

    out = run_ranks(_sp_head_grads, 2)
    _, _, full, w, weight = out[0]
    x = full.clone().requires_grad_(True)
    ref_head = torch.nn.Linear(full.shape[-1], 1)
    with torch.no_grad():
        ref_head.weight.copy_(weight)
    (ref_head(x).float() * w).sum().backward()
    for rank, (grad, head_grad, *_rest) in enumerate(out):
        torch.testing.assert_close(grad, x.grad[rank * 4:(rank + 1) * 4])
        torch.testing.assert_close(head_grad, ref_head.weight.grad)
