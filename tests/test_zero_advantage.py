"""The update skips the forward+backward of rows whose advantage is 0 everywhere (a GRPO group
whose samples all scored the same) and changes nothing by it: the same weights after the
optimizer step, the same step metrics, on one rank and on two ranks of which one has only such
rows, on both backends (the update loop is one, engine/backends/base.py). And it skips nothing
when the loss has a term that such rows still feed (KL, entropy)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.zero_advantage import split_rows, trains_nothing
from engine.batch import SequenceBatch
from engine.config.load import load_run_config
from tests.dist_utils import run_ranks

VOCAB, PAD, EOS = 12, 0, 1
G = 4  # samples per prompt


def _batch(idle_groups: list[int]) -> SequenceBatch:
    """4 prompt groups x G samples; the groups in ``idle_groups`` have zero advantage."""
    g = torch.Generator().manual_seed(0)
    rows, P, T = 4 * G, 3, 11
    prompts = torch.randint(2, VOCAB, (4, P), generator=g).repeat_interleave(G, 0)
    ids = torch.cat([prompts, torch.randint(2, VOCAB, (rows, T - P), generator=g)], 1)
    lengths = torch.randint(P + 2, T + 1, (rows,), generator=g)
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    resp = attn.float().clone()
    resp[:, :P] = 0
    adv = torch.randn(rows, generator=g)[:, None] * resp
    for grp in idle_groups:
        adv[grp * G:(grp + 1) * G] = 0.0
    rollout_lp = -torch.rand(rows, T, generator=g) * resp
    return SequenceBatch(input_ids=ids * attn, attention_mask=attn, response_mask=resp,
                         prompt_lengths=torch.full((rows,), P), advantages=adv, rollout_log_probs=rollout_lp)


def _step(rank, world, batch, overrides, backend="fsdp"):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.registry import engine_class
    from engine.trainer.worker_group import shard_slices

    cfg = load_run_config(["engine.micro_batch_size=3", *overrides], engine=backend).config
    eng = engine_class(backend)(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    shard = batch.select(shard_slices(len(batch), world)[rank])
    stats = eng.train_step(shard, PolicyLoss(cfg.algorithm, world))
    return {k: v.clone() for k, v in eng.export_hf_state_dict().items()}, stats.metrics, stats.tokens


def _on_and_off(rank, world, batch, extra, backend):
    """The step with skipping and the step without, built one after the other in one process
    (each engine from the same seed: ``_step`` builds its own)."""
    return [_step(rank, world, batch, [f"engine.skip_zero_advantage_rows={skip}", *extra], backend)
            for skip in ("true", "false")]


def _compare(world: int, batch: SequenceBatch, extra: list[str], backend: str = "fsdp"):
    both = run_ranks(_on_and_off, world, batch, extra, backend)
    on, off = [r[0] for r in both], [r[1] for r in both]
    # The step with skipping against the step without, relative to the step's size: measured
    # 1.6e-5 (token-mean) and 6e-5 (seq-mean-token-mean), what changing engine.micro_batch_size
    # from 3 to 2 does too (1.1e-5, 1.2e-4: fp32 summation order, which AdamW's first step
    # amplifies on near-zero gradients). A skipped row that mattered would move it by ~1.
    w_on, w_off, w0 = on[0][0], off[0][0], _initial()
    step = sum(((w_off[k] - w0[k]) ** 2).sum() for k in w_off).sqrt()
    gap = sum(((w_on[k] - w_off[k]) ** 2).sum() for k in w_off).sqrt()
    assert step > 1e-3  # the step really trained
    assert gap / step < 1e-3, float(gap / step)
    sums_on = {k: sum(r[1].get(k, 0.0) for r in on) for k in on[0][1]}
    sums_off = {k: sum(r[1].get(k, 0.0) for r in off) for k in off[0][1]}
    return sums_on, sums_off, sum(r[2] for r in on), sum(r[2] for r in off)


_INITIAL: dict = {}


def _initial() -> dict:
    if not _INITIAL:
        _INITIAL.update(run_ranks(_weights, 1)[0])
    return _INITIAL


def _weights(rank, world):
    from engine.backends.fsdp import FSDPEngine

    cfg = load_run_config([]).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    return {k: v.clone() for k, v in eng.export_hf_state_dict().items()}


def test_idle_rows_are_those_with_zero_advantage_on_every_response_token():
    b = _batch(idle_groups=[1, 3])
    idle = trains_nothing(b)
    assert idle.tolist() == [g in (1, 3) for g in range(4) for _ in range(G)]
    split = split_rows(b, enabled=True)
    assert split.skip == [i for i in range(4 * G) if idle[i]] and len(split.train) == 2 * G
    assert split_rows(b, enabled=False).skip == []
    # a shard of idle rows only still trains one (its collectives must run)
    only_idle = b.select(list(range(G, 2 * G)))
    s = split_rows(only_idle, enabled=True)
    assert s.train == [0] and s.skip == list(range(1, G))


def test_skipping_idle_rows_gives_the_same_step_on_one_rank():
    """Half the groups idle: weights after the step and every metric as without skipping, with
    fewer tokens through forward+backward."""
    batch = _batch(idle_groups=[0, 2])
    on, off, tok_on, tok_off = _compare(1, batch, ["algorithm.loss_agg_mode=seq-mean-token-mean"])
    assert on.pop("rows_skipped") == 2 * G
    assert on.keys() == off.keys() and {"pg_loss", "clip_frac", "entropy", "rollout_kl"} <= set(off)
    for k in off:
        assert abs(on[k] - off[k]) < 1e-5, (k, on[k], off[k])
    assert tok_on < 0.7 * tok_off


@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.slow)])
def test_skipping_idle_rows_on_two_ranks_when_one_rank_has_only_idle_rows(backend):
    """Rank 1's half of the batch is all idle: it trains one row, skips the rest, and the two
    ranks' step equals the unskipped one (token-mean loss); megatron too (two data-parallel
    ranks: megatron reduces gradients once, after the last micro-batch)."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    batch = _batch(idle_groups=[2, 3])
    on, off, tok_on, tok_off = _compare(2, batch, [], backend)
    assert on.pop("rows_skipped") == 2 * G - 1
    for k in off:
        assert abs(on[k] - off[k]) < 1e-5, (k, on[k], off[k])
    assert tok_on < tok_off


def _skipped(rank, world, batch, runs):
    """rows_skipped of one step for each override list in ``runs`` (one process for all)."""
    return [_step(rank, world, batch, overrides)[1].get("rows_skipped") for overrides in runs]


def test_nothing_is_skipped_when_idle_rows_still_feed_the_loss():
    """An entropy bonus or KL in the loss gives zero-advantage rows a gradient: they are trained."""
    batch = _batch(idle_groups=[0, 1])
    runs = [[], ["algorithm.entropy_coef=0.01"], ["engine.skip_zero_advantage_rows=false"]]
    assert run_ranks(_skipped, 1, batch, runs)[0] == [2 * G, None, None]
    from engine.algorithms.policy_loss import PolicyLoss

    def idle_ok(*o):
        return PolicyLoss(load_run_config(list(o)).config.algorithm).idle_rows_train_nothing

    assert idle_ok() and not idle_ok("algorithm.kl_coef=0.01", "algorithm.use_kl_loss=true")
    assert idle_ok("algorithm.kl_coef=0.01", "algorithm.use_kl_loss=false")  # KL in the reward: in the advantage


def _mixed_layout_step(rank, world, batch, old_layout):
    from engine.backends.fsdp import FSDPEngine

    if old_layout:  # each rank decides alone (the code before the fix)
        FSDPEngine._layouts = lambda self, mbs: [self._groups(mb.batch) for mb in mbs]
    return _step(rank, world, batch, ["engine.skip_zero_advantage_rows=false", "engine.micro_batch_size=8"])[0]


def _mixed_batch() -> SequenceBatch:
    """Rank 0's 8 rows: two prompts x 4 samples; rank 1's 8 rows: 8 distinct prompts."""
    b = _batch(idle_groups=[])
    distinct = torch.randint(2, VOCAB, (8, 3), generator=torch.Generator().manual_seed(1))
    b.input_ids[8:, :3] = distinct
    return b


def test_ranks_agree_on_the_grouped_or_plain_forward():
    """One rank's micro-batch repeats prompts (grouped forward: the model runs twice), the
    other's does not (plain forward: once). Before, FSDP's collectives then mismatched and the
    ranks aborted; now both take the plain forward for that micro-batch, and the step equals
    one rank's step on the whole batch."""
    batch = _mixed_batch()
    two = run_ranks(_mixed_layout_step, 2, batch, False)
    one = run_ranks(_step, 1, batch, ["engine.skip_zero_advantage_rows=false", "engine.micro_batch_size=8"])[0][0]
    w0 = _initial()
    step = sum(((one[k] - w0[k]) ** 2).sum() for k in one).sqrt()
    gap = sum(((two[0][k] - one[k]) ** 2).sum() for k in one).sqrt()
    assert gap / step < 1e-3, float(gap / step)
