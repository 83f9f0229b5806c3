"""The megatron backend's checkpoint access to megatron-core's DistributedOptimizer (the GPU
default, `engine.use_distributed_optimizer`), against first principles: Adam state saved after
two steps and loaded into a fresh optimizer, sharded over two data-parallel ranks, continues as
an uninterrupted AdamW does.

megatron's optimizers allocate on CUDA, so the DistributedOptimizer here is megatron-core's class
with only what this access reads filled in: its real `_get_main_param_and_optimizer_states` over
a real torch AdamW on each rank's slice of the main parameter (what megatron gives it when
Transformer-Engine and Apex are absent), each rank's slice as `_get_model_param_range_map` states
it, and real gloo collectives. A fresh AdamW has no state until its first step (torch creates it
there), which is where a resumed run starts: loading used to copy only the keys already present,
so the moments and the step count were dropped without a word.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_ranks

pytest.importorskip("megatron.core")

ROWS, COLS = 6, 4
LR, BETAS, EPS = 1e-2, (0.9, 0.99), 1e-8


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, COLS, generator=g) for _ in range(3)]


def _uninterrupted() -> tuple[torch.Tensor, dict, torch.Tensor]:
    """AdamW on the whole parameter: (value and state after two steps, value after the third)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(ROWS, COLS))
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    g1, g2, g3 = _grads()
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
    saved = p.detach().clone(), {k: v.detach().clone() for k, v in opt.state[p].items()}
    p.grad = g3.clone()
    opt.step()
    return saved[0], saved[1], p.detach().clone()


def _megatron_optimizer(rank: int, world: int, model_param: torch.nn.Parameter, main_value: torch.Tensor):
    """MegatronOptimizer over one DistributedOptimizer whose rank holds an equal slice."""
    import torch.distributed as dist
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    from engine.backends.megatron.optimizer import MegatronOptimizer

    n = model_param.numel() // world
    lo, hi = rank * n, (rank + 1) * n
    shard = torch.nn.Parameter(main_value.reshape(-1)[lo:hi].clone())
    d = object.__new__(DistributedOptimizer)
    d.optimizer = torch.optim.AdamW([shard], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    d.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    d.model_param_group_index_map = {model_param: (0, 0)}
    d._get_model_param_range_map = lambda p: {"param": Range(lo, hi)}
    d.data_parallel_group = dist.group.WORLD
    d.buffers = [SimpleNamespace(param_index_map={model_param: (0, model_param.numel(), 0)})]
    mo = object.__new__(MegatronOptimizer)
    mo.params, mo.megatron = [model_param], SimpleNamespace(chained_optimizers=[d])
    mo._index()
    return mo, d, shard, (lo, hi)


def _resume_on_rank(rank: int, world: int):
    saved_value, saved_state, _ = _uninterrupted()
    model_param = torch.nn.Parameter(saved_value.clone())
    mo, d, shard, (lo, hi) = _megatron_optimizer(rank, world, model_param, saved_value)
    assert not d.optimizer.state[shard]  # a fresh process: no Adam state before the first step
    # reading the slice's state made an empty entry: that is not state (the coverage check)
    fresh = {"has": mo.has_state(model_param), "state": mo.state(model_param)}
    mo.set_state(model_param, {k: v.clone() for k, v in saved_state.items()})
    fresh["has_after"] = mo.has_state(model_param)
    back = mo.state(model_param)  # collective: the full, unsharded state again
    shard.grad = _grads()[2].reshape(-1)[lo:hi].clone()
    d.optimizer.step()
    return {"state": {k: v.clone() for k, v in back.items()}, "slice": (lo, hi), "after": shard.detach().clone(),
            "fresh": fresh}


def test_resumed_distributed_optimizer_continues_as_uninterrupted_adamw():
    saved_value, saved_state, third = _uninterrupted()
    results = run_ranks(_resume_on_rank, 2)
    for r in results:
        assert r["fresh"] == {"has": False, "state": {}, "has_after": True}
        assert torch.equal(r["state"]["exp_avg"], saved_state["exp_avg"])
        assert torch.equal(r["state"]["exp_avg_sq"], saved_state["exp_avg_sq"])
        assert float(r["state"]["step"]) == float(saved_state["step"]) == 2.0
        lo, hi = r["slice"]
        # the third step from the loaded state is the uninterrupted third step, to the bit
        assert torch.equal(r["after"], third.reshape(-1)[lo:hi])
    assert [r["slice"] for r in results] == [(0, 12), (12, 24)]


def test_expert_parameters_belong_to_the_expert_optimizer_of_the_chain():
    """With expert parallelism megatron chains a second DistributedOptimizer for the experts (over
    the expert-data-parallel group): each parameter is read and loaded through the optimizer
    whose buffers hold it, not the first of the chain."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from engine.backends.megatron.optimizer import MegatronOptimizer

    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    chain = []
    for p in (dense, expert):
        d = object.__new__(DistributedOptimizer)
        d.buffers = [SimpleNamespace(param_index_map={p: (0, p.numel(), 0)})]
        chain.append(d)
    mo = object.__new__(MegatronOptimizer)
    mo.params, mo.megatron = [dense, expert], SimpleNamespace(chained_optimizers=chain)
    mo._index()
    assert mo._where[id(dense)][0] is chain[0] and mo._where[id(expert)][0] is chain[1]


def _one_rank_holds_nothing(rank: int, world: int):
    """Rank 0's slice is the whole parameter, with Adam state after two steps; rank 1's slice of
    the buffers holds no parameter (a small model or an expert optimizer over many data-parallel
    ranks), so it has no Adam state of its own."""
    import torch.distributed as dist
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    from engine.backends.megatron.optimizer import MegatronOptimizer

    saved_value, saved_state, _ = _uninterrupted()
    model_param = torch.nn.Parameter(saved_value.clone())
    shard = torch.nn.Parameter(saved_value.reshape(-1).clone())
    d = object.__new__(DistributedOptimizer)
    d.optimizer = torch.optim.AdamW([shard], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    d.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    d.model_param_group_index_map = {model_param: (0, 0)} if rank == 0 else {}
    d._get_model_param_range_map = lambda p: {"param": Range(0, model_param.numel())}
    d.data_parallel_group = dist.group.WORLD
    d.buffers = [SimpleNamespace(param_index_map={model_param: (0, model_param.numel(), 0)})]
    if rank == 0:
        d.optimizer.state[shard] = {k: v.reshape(-1).clone() if v.dim() else v.clone() for k, v in saved_state.items()}
    mo = object.__new__(MegatronOptimizer)
    mo.params, mo.megatron = [model_param], SimpleNamespace(chained_optimizers=[d])
    mo._index()
    return {k: v.clone() for k, v in mo.state(model_param).items()}


@pytest.mark.timeout(120)
def test_a_rank_without_state_joins_the_others_reading_it():
    """Each rank used to decide alone whether its optimizer held state: the rank without any
    returned nothing and skipped the all-reduces rank 0 then waited in (a hang at the first
    checkpoint, or a collective mismatch). Now every rank gets the full state and rank 0's step."""
    _, saved_state, _ = _uninterrupted()
    for got in run_ranks(_one_rank_holds_nothing, 2):
        assert set(got) == {"exp_avg", "exp_avg_sq", "step"}
        assert torch.equal(got["exp_avg"], saved_state["exp_avg"])
        assert torch.equal(got["exp_avg_sq"], saved_state["exp_avg_sq"])
        assert float(got["step"]) == 2.0
