"""A nan/inf gradient is never applied: the FSDP engine (on every rank at once) and megatron's
CPU optimizer skip the step and say so; the run raises the `nonfinite_grad` alarm, and a run
whose every update keeps failing stops with a clear error instead of training on nan."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.config.load import load_run_config
from tests.cli_utils import rl
from tests.dist_utils import run_ranks
from tests.test_fsdp_engine import _batch, _engine


def _nan_then_finite(rank, world):
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.trainer.worker_group import shard_slices

    cfg, eng = _engine(["engine.micro_batch_size=2"])
    good = _batch()
    bad = good.select(slice(0, len(good)))
    bad.advantages = bad.advantages.clone()
    bad.advantages[0, 3] = float("nan")  # only rank 0's shard holds it
    before = {k: v.clone() for k, v in eng.export_hf_state_dict().items()}
    out = []
    for batch in (bad, good):
        stats = eng.train_step(batch.select(shard_slices(len(batch), world)[rank]), PolicyLoss(cfg.algorithm, world))
        after = eng.export_hf_state_dict()
        out.append({"skipped": stats.replicated["nonfinite_updates"], "grad_norm": stats.replicated["grad_norm"],
                    "changed": any(not torch.equal(before[k], after[k]) for k in before),
                    "finite": all(bool(torch.isfinite(v).all()) for v in after.values())})
        before = {k: v.clone() for k, v in after.items()}
    return out


def test_fsdp_skips_a_nan_gradient_on_every_rank_then_trains():
    """A nan in one rank's shard made the global gradient norm nan and AdamW wrote nan into every
    weight on every rank; the next rollout then died with an IndexError in the sampler."""
    for bad, good in run_ranks(_nan_then_finite, 2):
        assert bad["skipped"] == 1.0 and math.isnan(bad["grad_norm"]) and not bad["changed"] and bad["finite"], bad
        assert good["skipped"] == 0.0 and math.isfinite(good["grad_norm"]) and good["changed"] and good["finite"]


def test_megatron_cpu_optimizer_skips_a_nan_gradient():
    from engine.backends.megatron.optimizer import MainGradAdamW

    cfg = load_run_config([]).config.optim
    p = torch.nn.Parameter(torch.ones(4))
    opt = MainGradAdamW([p], cfg, total_updates=10)
    p.main_grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    assert math.isinf(opt.step(1.0))
    assert torch.equal(p.detach(), torch.ones(4)) and not opt.optimizer.state  # no AdamW step was taken
    p.main_grad = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert math.isfinite(opt.step(1.0)) and not torch.equal(p.detach(), torch.ones(4))


def test_nonfinite_alarm_names_what_was_skipped():
    from engine.algorithms.alarms import AlarmMonitor

    mon = AlarmMonitor(load_run_config([]).config.alarms)
    row = {"step": 1, "reward_mean": 0.1, "algo": {}}
    assert mon.observe(row) == []
    alarms = mon.observe(row | {"step": 2, "algo": {"nonfinite_updates": 2, "value_nonfinite_updates": 1,
                                                     "updates": 4}})
    assert [a.kind for a in alarms] == ["nonfinite_grad"]
    assert "2 policy and 1 critic update(s) of 4" in alarms[0].message and "optim.lr" in alarms[0].message


@pytest.mark.slow
def test_a_run_that_keeps_diverging_stops_cleanly(tmp_path):
    """optim.lr=1e30: after the first update every gradient is nan. The run used to train on
    (nan loss in every row, nothing learned, to total_steps); now each update is skipped and
    alarms.nonfinite_steps=2 such steps in a row stop it with exit 2 and no traceback."""
    r = rl("train", f"checkpoint.dir={tmp_path / 'run'}", "optim.lr=1e30", "optim.grad_clip=0", "trainer.total_steps=10",
           "alarms.nonfinite_steps=2", "task.num_val=0", "trainer.val_freq=0")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Training diverged" in " ".join(r.stderr.split()), r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) < 10 and [x["algo"].get("nonfinite_updates") for x in rows[-2:]] == [1, 1], rows
    assert any(a["kind"] == "nonfinite_grad" for x in rows for a in x["alarms"])
