"""algorithm=ppo: the critic's value loss and value alignment by hand; the FSDP2 critic follows
param/optimizer offload; and through the real `rl train` / `rl resume` on both engines: PPO
learns the default task, resume with a critic is bit-exact, `rl inspect-ckpt` shows the critic.
(The megatron critic's own checks: tests/test_megatron_critic.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.algorithms.value_loss import value_loss
from engine.backends.fsdp.critic import ValueModel
from tests.cli_utils import cli, rl as run_rl
from tests.dist_utils import full_tensor, run_ranks


def test_value_loss_clips_by_hand():
    v = torch.tensor([[0.0, 1.0, 0.2]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    ret = torch.tensor([[0.0, 2.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, frac = value_loss(v, old, ret, mask, clip=0.5, n_tokens=2)
    # token 1: unclipped (1-2)^2 = 1, clipped 0.5 -> (0.5-2)^2 = 2.25 -> 2.25
    # token 2: within the clip range -> (0.2-1)^2 = 0.64 both
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.64) / 2)
    assert frac.item() == pytest.approx(0.5)


def test_value_model_reads_the_prefix_before_each_token():
    from engine.config.schema import ModelConfig
    from engine.model.build import build_hf_model

    lm = build_hf_model(ModelConfig(), "", 16, 0, 0, 1)
    vm = ValueModel(lm.model, lm.config.hidden_size)
    torch.nn.init.normal_(vm.value_head.weight)
    ids = torch.tensor([[3, 4, 5, 6]])
    v = vm(ids, torch.ones_like(ids))
    assert v.shape == (1, 4) and v[0, 0] == 0
    # V at t depends only on tokens < t: changing token 3 leaves positions 0..3 unchanged
    v2 = vm(torch.tensor([[3, 4, 5, 9]]), torch.ones_like(ids))
    assert torch.equal(v[0, :4], v2[0, :4])
    v3 = vm(torch.tensor([[3, 4, 9, 6]]), torch.ones_like(ids))
    assert torch.equal(v[0, :3], v3[0, :3]) and v[0, 3] != v3[0, 3]


def rl(*args, timeout=1200):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, timeout=timeout)


# 30 steps on both engines, which train the same model since the pad token's embedding trains on
# both (fsdp 0.133 -> 0.322, 2.4x; megatron 0.133 -> 0.370, 2.8x; at 20 steps neither has
# doubled: 1.8x); docs/algorithms.md has the figures
LEARN_STEPS = {"fsdp": 30, "megatron": 30}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_ppo_learns_the_default_task(tmp_path, engine):
    """The default job with algorithm=ppo: reward of the last 10 steps at least double the
    first 10, with the critic's loss reported every step."""
    d = tmp_path / "run"
    r = rl("train", f"--engine={engine}", "algorithm=ppo", f"trainer.total_steps={LEARN_STEPS[engine]}",
           f"checkpoint.dir={d}", "checkpoint.save_freq=0", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["reward_last10"] >= 2 * s["reward_first10"], s
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert all("value_loss" in row["algo"] for row in rows)


@pytest.mark.slow
def test_ppo_with_a_bf16_model_trains_its_critic(tmp_path):
    """model.dtype=bfloat16 (the natural GPU setting): FSDP2's mixed precision gathers the value
    head's weight in bf16 as well, and the head used to be fed an fp32 input (a dtype error at the
    critic's first forward, on any device). Two steps, the critic's loss finite both times."""
    d = tmp_path / "run"
    r = rl("train", "algorithm=ppo", "model.dtype=bfloat16", "trainer.total_steps=2", "data.train_batch_size=4",
           "algorithm.rollout_n=4", f"checkpoint.dir={d}", "checkpoint.save_freq=0", "checkpoint.save_final=false")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["algo"]["value_loss"] == row["algo"]["value_loss"] for row in rows)


def dcp_tensors(state_dir: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = state_dir.parent / "flat.pt"
    dcp_to_torch_save(str(state_dir), str(out))
    sd = torch.load(out, weights_only=False)
    out.unlink()

    def flat(prefix, d):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(f"{prefix}{k}.", v)
            else:
                yield f"{prefix}{k}", v
    return dict(flat("", sd))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_resume_with_a_critic_is_bit_exact(tmp_path, engine):
    """4 PPO steps straight == 2 steps, stop, `rl resume`, 2 more: identical policy, critic and
    both optimizers (every DCP entry) and identical metric rows; critic.warmup_steps=1 so the
    run covers a critic-only step too. `rl inspect-ckpt` lists the critic's groups."""
    common = [f"--engine={engine}", "algorithm=ppo", "trainer.total_steps=4", "data.train_batch_size=4",
              "algorithm.rollout_n=4", "critic.warmup_steps=1", "checkpoint.save_freq=2", "checkpoint.keep_last=0"]
    src = tmp_path / "straight"
    r = rl("train", *common, f"checkpoint.dir={src}")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "resumed"
    shutil.copytree(src, run)
    shutil.rmtree(run / "step_4")
    r = rl("resume", str(run), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = dcp_tensors(src / "step_4" / "state"), dcp_tensors(run / "step_4" / "state")
    assert any(k.startswith("critic.model.") for k in want) and any(k.startswith("critic.optim.") for k in want)
    assert set(want) == set(got)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert torch.equal(want[k], got[k]), k
        else:
            assert want[k] == got[k], k
    rows = lambda p: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines() if x.strip()]  # noqa: E731
    a, b = rows(src), rows(run)
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    for key in ("reward_mean", "pg_loss", "entropy"):
        assert [x[key] for x in a] == [x[key] for x in b], key
    assert [x["algo"]["value_loss"] for x in a] == [x["algo"]["value_loss"] for x in b]
    assert [x["algo"]["policy_updated"] for x in a] == [False, True, True, True]
    r = cli("inspect-ckpt", str(src / "step_4"), "--json")  # reads files only: in this process
    assert r.exit_code == 0, r.output[-3000:]
    groups = {g["group"]: g for g in json.loads(r.stdout)["groups"]}
    assert groups["critic model"]["tensors"] > 0 and groups["critic optimizer state"]["tensors"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_a_save_before_the_policys_first_update_changes_nothing(tmp_path, engine):
    """torch's get_state_dict gave the policy's fresh AdamW state with a zero-gradient step at lr 0
    (step 1, zero moments) when a checkpoint was saved during critic.warmup_steps: the first real
    update then counted its bias correction from 2, and the run differed from one that had not
    saved (entropy 2.4506 vs 2.4482 at step 4). Saving every step now gives the rows of a run that
    never saved; the checkpoint holds the policy optimizer's fresh state (FSDP: step 0, zero
    moments; megatron: none, param_state false, backfilled), and resuming from it is exact."""
    common = [f"--engine={engine}", "algorithm=ppo", "critic.warmup_steps=2", "trainer.total_steps=4",
              "data.train_batch_size=4", "algorithm.rollout_n=2", "checkpoint.keep_last=0"]
    saving, quiet = tmp_path / "saving", tmp_path / "quiet"
    r = rl("train", *common, "checkpoint.save_freq=1", f"checkpoint.dir={saving}")
    assert r.returncode == 0, r.stderr[-3000:]
    r = rl("train", *common, "checkpoint.save_freq=100", "checkpoint.save_final=false", f"checkpoint.dir={quiet}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = lambda p: [{k: x.get(k) for k in ("step", "reward_mean", "pg_loss", "entropy", "grad_norm")}  # noqa: E731
                      for x in map(json.loads, (p / "metrics.jsonl").read_text().splitlines())]
    assert rows(saving) == rows(quiet)
    manifest = json.loads((saving / "step_2" / "manifest.json").read_text())
    saved = dcp_tensors(saving / "step_2" / "state")
    steps = [v for k, v in saved.items() if k.startswith("optim.state.") and k.endswith(".step")]
    if engine == "fsdp":
        assert steps and all(float(v) == 0 for v in steps)
        moments = [v for k, v in saved.items() if k.startswith("optim.state.") and k.endswith((".exp_avg", ".exp_avg_sq"))]
        assert moments and all(float(v.abs().max()) == 0 for v in moments)
    else:
        assert set(manifest["optimizer"]["param_state"].values()) == {False} and not steps
    resumed = tmp_path / "resumed"
    shutil.copytree(saving, resumed)
    for d in ("step_2", "step_3", "step_4"):
        shutil.rmtree(resumed / d)
    r = rl("resume", str(resumed))
    assert r.returncode == 0, r.stderr[-3000:]
    assert rows(resumed) == rows(quiet)


def _critic_offload_round_trip(rank, world):
    """FSDP2 engine + critic, offload with CPU storages standing in for device memory."""
    import functools

    import engine.memory.offload as off
    from engine.backends.fsdp.critic import FSDPCritic
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config

    off.offload_params = functools.partial(off.offload_params, simulate_on_cpu=True)
    off.offload_optimizer_state = functools.partial(off.offload_optimizer_state, simulate_on_cpu=True)
    cfg = load_run_config(["algorithm=ppo", "engine.param_offload=true", "engine.optimizer_offload=true"]).config
    eng = FSDPEngine(cfg, "", 12, 0, 1, torch.device("cpu"), updates_per_step=1)
    eng.build()
    eng.critic = FSDPCritic(cfg, eng)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 12, (4, 8), generator=g)
    from engine.batch import SequenceBatch

    resp = (torch.arange(8)[None] >= 3).float().expand(4, -1).contiguous()
    batch = SequenceBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=resp,
                          prompt_lengths=torch.full((4,), 3), advantages=torch.zeros(4, 8),
                          values=torch.zeros(4, 8), returns=torch.rand(4, 8, generator=g) * resp)
    eng.critic.train_step(batch)   # AdamW state exists
    before = {k: full_tensor(v).clone() for k, v in eng.critic.model.state_dict().items()}
    opt_before = [t.clone() for st in eng.critic.optimizer.state.values() for t in st.values()]
    rep = eng.offload()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  (DTensor shards)
    shard = local(next(eng.critic.model.parameters()))
    moved = (shard.untyped_storage().size() == 0,
             all(local(t).untyped_storage().size() == 0 for st in eng.critic.optimizer.state.values()
                 for t in st.values() if t.dim() > 0))
    critic_bytes = sum(local(p).numel() * 4 for p in eng.critic.model.parameters())
    eng.onload()
    after = {k: full_tensor(v) for k, v in eng.critic.model.state_dict().items()}
    opt_after = [t for st in eng.critic.optimizer.state.values() for t in st.values()]
    return {"moved": moved, "bytes": (rep.param_bytes, rep.optimizer_bytes), "critic_bytes": critic_bytes,
            "exact": all(torch.equal(before[k], after[k]) for k in before)
            and all(torch.equal(a, b) for a, b in zip(opt_before, opt_after))}


def test_fsdp_critic_follows_param_and_optimizer_offload():
    """engine.param_offload / optimizer_offload move the critic's parameters and AdamW state out
    with the policy's (the real storage moves; CPU stands in for the device) and bring them back
    bit-exactly."""
    (r,) = run_ranks(_critic_offload_round_trip, 1)
    assert r["moved"] == (True, True)
    assert r["bytes"][0] >= 2 * r["critic_bytes"] and r["bytes"][1] > 0   # policy + critic params
    assert r["exact"]


def _estimate(*overrides) -> dict:
    """What `rl mem-report --estimate --engine=megatron OVERRIDES --json` prints under "estimate"
    (the engine call the command makes, in this process: four estimates share one import)."""
    from engine.memory.measure import estimate_only
    from rlcli.output import strict_json_value

    rep = estimate_only(list(overrides), engine="megatron")
    return json.loads(json.dumps(strict_json_value(rep.to_json()), default=str))["estimate"]


def test_mem_report_estimate_counts_the_critic_and_its_offload():
    """`rl mem-report --estimate` with algorithm=ppo: a second network and AdamW state per rank,
    a critic_update phase; with engine.param_offload the critic leaves the device with the
    policy (the rollout phase holds what it holds without a critic)."""
    grpo, ppo = _estimate(), _estimate("algorithm=ppo")
    assert ppo["per_rank"]["params"] == 2 * grpo["per_rank"]["params"]
    assert ppo["per_rank"]["optimizer"] == 2 * grpo["per_rank"]["optimizer"]
    assert "critic_update" in {p["phase"] for p in ppo["phases"]}
    phase = lambda est, name: next(p for p in est["phases"] if p["phase"] == name)  # noqa: E731
    off_grpo, off_ppo = _estimate("engine.param_offload=true"), _estimate("algorithm=ppo", "engine.param_offload=true")
    assert phase(off_ppo, "rollout")["categories"]["params"] == phase(off_grpo, "rollout")["categories"]["params"]
    assert phase(ppo, "rollout")["categories"]["params"] > phase(grpo, "rollout")["categories"]["params"]
