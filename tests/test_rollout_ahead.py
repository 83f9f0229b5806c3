"""Sampling ahead of the update (trainer.mode=one_step_off|async, docs/async.md).

Fast tests check the off-policy correction against its formula (the truncated importance weight,
token and sequence level, and the gradient it gives), the staleness record and how the modes
resolve. Slow tests run the real `rl train` / `rl resume` (Ray, the rollout worker actor):
staleness 0 is the synchronous trainer bit for bit; one_step_off trains every sample after the
first step on weights exactly one version older, async on at most trainer.max_staleness older; and
a one_step_off run resumed from a checkpoint continues exactly as the uninterrupted run (the
checkpoint keeps the queued rollouts and the rollout worker's generator).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from engine.algorithms.policy_loss import OffPolicy, PolicyLoss, rollout_is_weight
from engine.algorithms.staleness import rollout_ratio_metrics, staleness_record
from engine.batch import SequenceBatch
from engine.config.resolved import resolve_run, rollout_is_level, versions_ahead
from engine.config.schema import RunConfig
from tests.cli_utils import rl, rl_concurrently


# ---- the correction, from its formula ----------------------------------------------------------
def test_token_weight_is_the_truncated_ratio_of_old_to_rollout():
    old = torch.tensor([[-1.0, -0.5, -2.0, 0.0]])
    roll = torch.tensor([[-1.5, -0.5, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = rollout_is_weight(old, roll, mask, "token", cap=1.5)
    expected = [min(math.exp(0.5), 1.5), 1.0, math.exp(-1.9), 0.0]  # exp(0.5)=1.65 truncated; padding 0
    assert torch.allclose(w, torch.tensor([expected]), atol=1e-6)


def test_sequence_weight_is_the_product_over_the_response_truncated():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    roll = torch.tensor([[-1.2, -1.3, -9.0], [-0.9, -0.95, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = rollout_is_weight(old, roll, mask, "sequence", cap=2.0)
    assert torch.allclose(w[0, :2], torch.full((2,), math.exp(0.5)))  # exp(0.2) * exp(0.3), under the cap
    w = rollout_is_weight(old, roll, mask, "sequence", cap=1.6)
    assert torch.allclose(w[0, :2], torch.full((2,), 1.6))  # truncated
    assert torch.allclose(w[1, :2], torch.full((2,), math.exp(-0.15)))  # product of its tokens' ratios
    assert w[:, 2].abs().sum() == 0  # outside the response


def _mb(rollout_lp):
    ids = torch.tensor([[5, 6, 7, 8]])
    return SequenceBatch(input_ids=ids, attention_mask=torch.ones_like(ids),
                         response_mask=torch.tensor([[0.0, 1.0, 1.0, 1.0]]), prompt_lengths=torch.tensor([1]),
                         rollout_log_probs=rollout_lp, advantages=torch.tensor([[0.0, 1.0, -1.0, 2.0]]))


def test_gradient_is_the_ppo_gradient_times_the_weight():
    """With pi_old = pi_theta (one update per step), d loss / d log p_t = -A_t w_t / n_tokens on every
    response token: the PPO gradient scaled by the truncated weight, which carries no gradient."""
    cfg = RunConfig().algorithm
    log_p = torch.tensor([[0.0, -1.0, -2.0, -0.5]], requires_grad=True)
    roll = torch.tensor([[0.0, -1.4, -1.0, -0.5]])
    loss, metrics = PolicyLoss(cfg, 1, OffPolicy("token"))(log_p, None, _mb(roll), n_tokens=3.0, n_seqs=1.0)
    loss.backward()
    w = [0.0, min(math.exp(0.4), cfg.rollout_is_cap), math.exp(-1.0), 1.0]
    adv = [0.0, 1.0, -1.0, 2.0]
    expected = torch.tensor([[-a * x / 3.0 for a, x in zip(adv, w)]])
    assert torch.allclose(log_p.grad, expected, atol=1e-6)
    ratios = [math.exp(0.4), math.exp(-1.0), 1.0]
    assert metrics["rollout_ratio_mean"] == pytest.approx(sum(ratios) / 3, rel=1e-5)
    assert metrics["rollout_ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert metrics["rollout_ratio_min"] == pytest.approx(min(ratios), rel=1e-5)
    spread = rollout_ratio_metrics(metrics)
    var = sum(r * r for r in ratios) / 3 - (sum(ratios) / 3) ** 2
    assert spread["rollout_ratio_std"] == pytest.approx(math.sqrt(var), rel=1e-4)


def test_behavior_ratio_clips_against_the_sampler():
    """off_policy_ratio=behavior: the ratio is pi_theta / pi_rollout, so a token whose probability already
    rose past 1 + clip_ratio_high since it was sampled gets no more gradient for a positive advantage,
    and one still inside the clip range gets -A * ratio / n_tokens."""
    cfg = RunConfig().algorithm  # clip_ratio_high 0.28
    log_p = torch.tensor([[0.0, -1.0, -2.0, -0.5]], requires_grad=True)
    roll = torch.tensor([[0.0, -1.5, -2.1, -0.5]])  # token 1: ratio e^0.5 = 1.65 (past 1.28); token 2: e^0.1
    mb = _mb(roll)
    mb.advantages = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    loss, metrics = PolicyLoss(cfg, 1, OffPolicy(behavior_ratio=True, report=True))(log_p, None, mb, n_tokens=3.0,
                                                                                     n_seqs=1.0)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0, -math.exp(0.1) / 3, -1.0 / 3]])
    assert torch.allclose(log_p.grad, expected, atol=1e-6)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout_ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-5)


def test_behavior_clip_bounds_compound_per_version_behind():
    """behavior_clip=per_version: a sample one version behind is clipped at (1 + 0.28)^2 = 1.638 and
    (1 - 0.2)^2 = 0.64 of its sampling probability, not 1.28 / 0.8: the update that made it stale
    may have moved it by PPO's clip already. Token 1 (ratio e^0.4 = 1.49) and token 3 (ratio e^-0.3 =
    0.74, negative advantage) keep their gradient; token 2 (ratio e^0.5 = 1.65) is past the bound."""
    import dataclasses

    log_p0 = torch.tensor([[0.0, -1.0, -2.0, -0.8]])
    roll = torch.tensor([[0.0, -1.4, -2.5, -0.5]])
    adv = torch.tensor([[0.0, 1.0, 1.0, -1.0]])
    grads = {}
    for clip, behind in (("per_version", 1.0), ("fixed", 1.0), ("per_version", 0.0), ("per_version", None)):
        log_p = log_p0.clone().requires_grad_(True)
        mb = _mb(roll)
        mb.advantages = adv
        mb.versions_behind = None if behind is None else torch.full_like(adv, behind)
        cfg = dataclasses.replace(RunConfig().algorithm, behavior_clip=clip)
        loss, m = PolicyLoss(cfg, 1, OffPolicy(behavior_ratio=True))(log_p, None, mb, n_tokens=3.0, n_seqs=1.0)
        loss.backward()
        grads[(clip, behind)] = (log_p.grad.clone(), m["clip_frac"])
    g, frac = grads[("per_version", 1.0)]
    assert torch.allclose(g, torch.tensor([[0.0, -math.exp(0.4) / 3, 0.0, math.exp(-0.3) / 3]]), atol=1e-6)
    assert frac == pytest.approx(1 / 3)
    g, frac = grads[("fixed", 1.0)]  # 1.28 / 0.8: tokens 1, 2 and 3 all past the bounds
    assert torch.equal(g, torch.zeros_like(g)) and frac == pytest.approx(1.0)
    # no version behind: exactly the fixed bounds (the sync loss), and no field at all is the same
    assert torch.equal(grads[("per_version", 0.0)][0], grads[("per_version", None)][0])


def test_off_leaves_the_loss_as_it_was():
    """rollout_is=off (the sync default): the loss and its gradient ignore the rollout's log-probs."""
    cfg = RunConfig().algorithm
    grads = []
    for roll in (None, torch.tensor([[0.0, -3.0, -0.2, -0.1]])):
        log_p = torch.tensor([[0.0, -1.0, -2.0, -0.5]], requires_grad=True)
        loss, metrics = PolicyLoss(cfg, 1)(log_p, None, _mb(roll), n_tokens=3.0, n_seqs=1.0)
        loss.backward()
        grads.append(log_p.grad.clone())
        assert not any(k.startswith("rollout_ratio") for k in metrics)
    assert torch.equal(grads[0], grads[1])


def test_staleness_record_counts_every_sample():
    rec = staleness_record([3, 3, 2, 4], step=5)  # trained on version 4
    assert rec["policy_version"] == 4
    assert (rec["rows_0"], rec["rows_1"], rec["rows_2"]) == (1, 2, 1)
    assert rec["max"] == 2 and rec["mean"] == pytest.approx(1.0) and rec["min_sample_version"] == 2


@pytest.mark.parametrize("mode,staleness,ahead,level", [("sync", 3, 0, "off"), ("one_step_off", 3, 1, "off"),
                                                        ("async", 3, 3, "off"), ("async", 0, 0, "off")])
def test_modes_resolve(mode, staleness, ahead, level):
    cfg = RunConfig()
    cfg.trainer.mode, cfg.trainer.max_staleness = mode, staleness
    assert versions_ahead(cfg) == ahead and rollout_is_level(cfg) == level
    run = resolve_run(cfg)
    assert (run.versions_ahead, run.rollout_is, run.behavior_ratio) == (ahead, level, ahead > 0)
    cfg.algorithm.off_policy_ratio = "proximal"  # decoupled PPO: the truncated weight is on when sampling ahead
    assert rollout_is_level(cfg) == ("token" if ahead else "off")


def test_a_rollout_worker_without_a_gpu_of_its_own_is_pinned_to_the_first_ranks_gpu():
    """On GPUs the worker gets a GPU of its own only if one is free once the ranks hold theirs (Ray's
    available GPUs, not its total: a GPU another job holds would be waited for until the start times
    out). Sharing, it is pinned to rank 0's node and sees only the GPU Ray assigned rank 0: an actor
    asking for no GPU is scheduled on any node (the driver's first) and sees all of that node's GPUs."""
    from types import SimpleNamespace

    from engine.trainer.rollout_ahead import rollout_worker_gpus, shared_gpu_placement

    ranks = SimpleNamespace(info=[{"device": "cuda:0"}, {"device": "cuda:0"}],
                            placement=[{"node_id": "a" * 56, "gpu_ids": ["3"]}, {"node_id": "b" * 56, "gpu_ids": ["5"]}])
    assert rollout_worker_gpus(ranks, free_gpus=1.0) == 1
    assert rollout_worker_gpus(ranks, free_gpus=0.0) == 0, "all GPUs held: share, do not wait for one"
    assert rollout_worker_gpus(SimpleNamespace(info=[{"device": "cpu"}], placement=[]), free_gpus=4.0) == 0
    env = {"OMP_NUM_THREADS": "1"}
    opts = shared_gpu_placement(ranks, env)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert opts["runtime_env"]["env_vars"] is env
    strategy = opts["scheduling_strategy"]
    assert strategy.node_id == "a" * 56 and strategy.soft is False


def test_the_rollout_worker_computes_on_the_gpu_ray_assigned_it():
    """With a GPU of its own the worker was started on a bare ``cuda``: the current device, cuda:0,
    which is rank 0's GPU where the cluster keeps every GPU visible (Ray then leaves
    CUDA_VISIBLE_DEVICES alone); its own GPU stayed idle. It now takes the assigned one, as the
    ranks do (engine.device.assigned_cuda_index)."""
    from engine.trainer.rollout_worker import worker_device

    assert worker_device("cuda", [6], "0,1,2,3,4,5,6,7") == torch.device("cuda", 6)   # every GPU visible
    assert worker_device("cuda", [6], None) == torch.device("cuda", 6)
    assert worker_device("cuda", ["6"], "6") == torch.device("cuda", 0)               # Ray's default
    assert worker_device("cuda", [], "3") == torch.device("cuda", 0)   # sharing rank 0's GPU (no GPU of its own)
    assert worker_device("cpu", [], None) == torch.device("cpu")


def test_a_rollout_worker_on_a_gpu_of_its_own_never_puts_its_engine_to_sleep():
    """The worker's vLLM engine slept after every call (every turn in a multi-turn run): its KV
    cache freed and its weights copied to the host and back, which pays only where the first
    rank shares the GPU. With a GPU of its own (RolloutAhead.shares_gpu false) it stays awake;
    sharing, it sleeps after each call as before."""
    from engine.config.load import load_run_config
    from engine.config.resolved import resolve_run
    from engine.model.build import build_hf_model
    from engine.trainer.rollout_worker import RolloutWorker

    cfg = load_run_config(["trainer.mode=one_step_off", "rollout.max_new_tokens=4"]).config
    vocab = {"size": 64, "pad": 0, "eos": 1}
    weights = build_hf_model(cfg.model, "", 64, 0, 0, 1).state_dict()
    slept = {}
    for shares in (False, True):
        w = RolloutWorker(resolve_run(cfg), 1)
        w.setup("", vocab, weights, 0, "cpu", shares)
        calls = []
        w.sampler.sleep = lambda calls=calls: calls.append(1)
        w.generate([[3, 4, 5]], 2)
        list(w.generate_stream([[3, 4, 5]], 2))
        slept[shares] = len(calls)
    assert slept == {False: 0, True: 2}


def test_router_replay_ahead_is_refused():
    r = rl("train", "trainer.mode=one_step_off", "algorithm.router_replay=record", "checkpoint.dir=/nonexistent/x")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "router_replay" in r.stderr and "Traceback" not in r.stdout + r.stderr


def test_a_staleness_bound_past_32_is_refused():
    """Every version ahead is a batch the rollout worker is asked for at once: 100000 once queued that
    many calls on the actor and hung a 2-step run."""
    r = rl("train", "trainer.mode=async", "trainer.max_staleness=100000", "trainer.total_steps=2",
           "checkpoint.dir=/nonexistent/x", timeout=60)
    said = " ".join(r.stderr.replace("│", " ").split())
    assert r.returncode == 2 and "`trainer.max_staleness` must be <= 32; got 100000" in said, r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr


def test_a_staleness_bound_outside_async_is_refused():
    """one_step_off is staleness 1 by definition and sync 0: a max_staleness given with them would be
    silently ignored, so it is refused naming the mode that reads it."""
    r = rl("train", "trainer.mode=one_step_off", "trainer.max_staleness=3", "checkpoint.dir=/nonexistent/x", timeout=60)
    said = " ".join(r.stderr.replace("│", " ").split())
    assert r.returncode == 2 and "`trainer.max_staleness` is read only with trainer.mode=async, and this run's " \
        "trainer.mode is `one_step_off`" in said, r.stderr[-2000:]


def test_a_weight_that_would_be_one_is_refused():
    """rollout_is=token with the behaviour ratio under one_step_off: pi_old is then pi_rollout, the weight
    is 1, and the user asked for a correction that cannot happen."""
    r = rl("train", "trainer.mode=one_step_off", "algorithm.rollout_is=token", "checkpoint.dir=/nonexistent/x")
    assert r.returncode == 2 and "off_policy_ratio=proximal" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr


# ---- slow: the real thing -------------------------------------------------------------------------
TINY = ["trainer.total_steps=4", "data.train_batch_size=4", "algorithm.rollout_n=4", "task.num_train=16",
        "trainer.threads_per_rank=1", "checkpoint.keep_last=0"]
ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}
TRAINED = ("reward_mean", "pg_loss", "grad_norm", "entropy", "clip_frac", "response_len_mean", "rollout_kl")


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def final_weights(run: Path, step: int) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run / f"flat-{step}.pt"
    dcp_to_torch_save(str(run / f"step_{step}" / "state"), str(out))
    sd = torch.load(out, weights_only=False)
    out.unlink()
    return {f"{top}.{k}": v for top, d in sd.items() for k, v in d.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Five 4-step runs of one config, all at once (most of a tiny run is start-up waiting):
    sync, async with max_staleness=0, one_step_off (checkpoints at 2 and 4), async with
    max_staleness=2 (5 steps) and streamed (one group a chunk, DAPO's dynamic sampling, a KL
    reference; checkpoints at 2 and 4)."""
    base = tmp_path_factory.mktemp("ahead")
    modes = {"sync": ["trainer.mode=sync"], "async0": ["trainer.mode=async", "trainer.max_staleness=0"],
             "one_step_off": ["trainer.mode=one_step_off", "checkpoint.save_freq=2"],
             "async2": ["trainer.mode=async", "trainer.max_staleness=2", "trainer.total_steps=5"],
             "streamed": ["trainer.mode=streamed", "trainer.stream_chunk_groups=1", "algorithm.dynamic_sampling=true",
                          "algorithm.kl_coef=0.01", "checkpoint.save_freq=2"]}
    dirs = {name: base / name for name in modes}
    results = rl_concurrently(*[["train", *TINY, *modes[m], f"checkpoint.dir={dirs[m]}"] for m in modes],
                              timeout=900, env=ENV)
    for m, r in zip(modes, results):
        assert r.returncode == 0, f"{m}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
    return dirs


@pytest.mark.slow
def test_staleness_zero_is_the_sync_trainer_bit_for_bit(runs):
    a, b = rows(runs["sync"]), rows(runs["async0"])
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert {k: x[k] for k in TRAINED} == {k: y[k] for k in TRAINED}, x["step"]
        assert x["algo"] == y["algo"] and y["staleness"] == {}
    wa, wb = final_weights(runs["sync"], 4), final_weights(runs["async0"], 4)
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_one_step_off_trains_on_samples_exactly_one_version_old(runs):
    r = rows(runs["one_step_off"])
    assert [x["staleness"]["policy_version"] for x in r] == [0, 1, 2, 3]
    assert r[0]["staleness"]["rows_0"] == 16 and r[0]["staleness"]["max"] == 0  # step 1: nothing to be ahead of
    for x in r[1:]:
        assert x["staleness"]["rows_1"] == 16 and x["staleness"]["max"] == 1, x["staleness"]
        assert x["algo"]["rollout_ratio_std"] > 0  # the weights moved between sampling and training
    # step 1's samples came from the weights being trained: the worker's copy computes what the ranks do
    assert r[0]["algo"]["rollout_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert "rollout_wait" in r[1]["timing"]


@pytest.mark.slow
def test_async_staleness_never_exceeds_its_bound(runs):
    st = [x["staleness"] for x in rows(runs["async2"])]
    assert [s["max"] for s in st] == [0, 1, 2, 2, 2]  # the queue fills, then stays max_staleness ahead
    assert all(s.get(f"rows_{s['max']}") == 16 for s in st)


@pytest.mark.slow
def test_plot_by_version_sets_each_batch_at_the_weights_that_sampled_it(runs):
    """`rl plot --x version` on the trainer's own rows: sync's step k was sampled by the weights
    after k - 1 updates, one_step_off's by those after k - 2 (step 1 and 2 both by the initial
    weights), async with max_staleness=2's by k - 3 once its queue is full."""
    r = rl("plot", str(runs["sync"]), str(runs["one_step_off"]), str(runs["async2"]), "--x", "version", "--json")
    assert r.returncode == 0, r.stderr
    assert [x["x"] for x in json.loads(r.stdout)["runs"]] == [[0, 1, 2, 3], [0, 0, 1, 2], [0, 0, 0, 1, 2]]


def test_the_run_summary_says_how_far_behind_the_samples_are():
    """A run that samples ahead says so beside its reward (a step's reward is of older weights
    than a sync run's at that step) and how to compare it with one; a sync run adds nothing."""
    from types import SimpleNamespace

    from rich.console import Console

    from rlcli.render.train import summary_table

    def shown(lag):
        s = SimpleNamespace(first_step=1, last_step=3, steps_run=3, reward_first10=0.1, improvement=None,
                            reward_last10=0.2, val_before=None, val_after=None, alarms=[], stopped_by_alarm=None,
                            wall_time_s=1.0, metrics_path="ckpt/metrics.jsonl", tracking={}, checkpoints=[],
                            run_dir="ckpt", versions_ahead=lag)
        console = Console(width=200, record=True, color_system=None)
        console.print(summary_table(s))
        return console.export_text()

    assert "samples" not in shown(0)
    assert "up to 2 updates behind the weights that trained on them" in shown(2)
    assert "rl plot ckpt SYNC_RUN --x version" in shown(1) and "up to 1 update behind" in shown(1)


@pytest.mark.slow
def test_one_step_off_resume_continues_exactly(runs, tmp_path):
    """Stopped after step 2's checkpoint and resumed: steps 3-4 and the final state equal the
    uninterrupted run's; the checkpoint held step 3's rollouts, sampled ahead at version 1."""
    src = runs["one_step_off"]
    dst = _without_step_4(src, tmp_path)
    queue = torch.load(dst / "step_2" / "rollout_queue.pt", weights_only=True)
    assert len(queue["queue"]) == 1 and queue["queue"][0]["stats"]["version"] == 1
    shown = rl("inspect-ckpt", str(dst / "step_2"), env=ENV)
    assert "4 prompts sampled, not yet trained (trainer.mode=one_step_off)" in shown.stdout, shown.stdout
    _resume_equals_straight(src, dst, "staleness")


def _without_step_4(src: Path, tmp_path: Path) -> Path:
    """A copy of run ``src`` stopped after step 2's checkpoint (its rows past it are truncated on resume)."""
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "step_4")
    return dst


def _resume_equals_straight(src: Path, dst: Path, also: str) -> None:
    """`rl resume dst`: steps 3-4 (TRAINED and the rows' ``also``) and the final weights equal ``src``'s."""
    r = rl("resume", str(dst), timeout=900, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = rows(src), rows(dst)
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:]):
        assert {k: x[k] for k in TRAINED} == {k: y[k] for k in TRAINED}, x["step"]
        assert x[also] == y[also]
    wa, wb = final_weights(src, 4), final_weights(dst, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_streamed_trains_every_sample_on_the_weights_that_drew_it(runs):
    """trainer.mode=streamed is on-policy: step k's rows were all sampled by the weights after
    k - 1 updates (the worker's copy, which computes what the ranks do), through dynamic sampling's
    rounds, and the update ran while groups were still arriving."""
    r = rows(runs["streamed"])
    assert [x["staleness"]["policy_version"] for x in r] == [0, 1, 2, 3]
    for x in r:
        assert x["staleness"]["max"] == 0 and x["staleness"]["rows_0"] == 16, x["staleness"]
        assert x["algo"]["rollout_ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert x["algo"]["rollout_ratio_min"] == pytest.approx(1.0, abs=1e-4)
        assert x["algo"]["batch_rows"] == 16 and x["algo"]["dynamic_sampling_rounds"] >= 1
        assert x["kl"] is not None
        assert x["timing"]["update"] >= x["timing"]["update_after_rollout"] > 0


@pytest.mark.slow
def test_streamed_resume_continues_exactly(runs, tmp_path):
    """Stopped after step 2's checkpoint and resumed: steps 3-4 and the final weights equal the
    uninterrupted run's (nothing is in flight at a checkpoint; the worker's sampling stream is kept)."""
    src = runs["streamed"]
    _resume_equals_straight(src, _without_step_4(src, tmp_path), "algo")


@pytest.mark.slow
def test_mode_cannot_change_on_resume(runs, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(runs["one_step_off"], dst)
    r = rl("resume", str(dst), "trainer.mode=sync", "trainer.total_steps=6", env=ENV)
    assert r.returncode == 2 and "trainer.mode" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr


SCORE_LOG_REWARDS = '''
import json, os, threading, time

def slow_first_char(prompts, completions, answer, trainer_state, **kw):
    """TRL-style batched: 1 when the completion starts with the answer's first letter; 0.4 s a call."""
    time.sleep(0.4)
    scores = [float(bool(c) and c[0] == a[0]) for c, a in zip(completions, answer)]
    with open(os.environ["RL_SCORE_LOG"], "a") as f:
        f.write(json.dumps({"global_step": trainer_state.global_step, "rows": len(completions),
                            "thread": threading.current_thread().name, "mean": sum(scores) / len(scores)}) + "\\n")
    return scores
'''


@pytest.mark.slow
def test_one_step_off_scores_the_next_batch_while_the_ranks_update(tmp_path):
    """A queued batch is scored on the driver's scoring thread as soon as the rollout worker returns
    it, not at the start of the step that trains on it: each batch's reward function runs on that
    thread (step 1's too, which the step samples itself, and before step 2's: CI once saw step 2's
    batch scored first when step 1's was scored on the main thread), sees the trainer state of the
    step that trains on it (global_step = step - 1, in order), and the step's logged reward is what
    the function returned for that batch; the step's `reward` timing is what it still waited (from
    the batch's arrival), `reward_ahead` the 0.4 s of scoring."""
    rows_in = [{"prompt": f"say {w}:", "answer": w} for w in ["hi", "ok", "yes", "no"] * 4]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    (tmp_path / "scorelog.py").write_text(SCORE_LOG_REWARDS)
    log = tmp_path / "scores.jsonl"
    r = rl("train", "task=dataset", "task.path=train.jsonl", "task.reward_fn=scorelog:slow_first_char", "task.num_val=0",
           "trainer.mode=one_step_off", "trainer.total_steps=4", "data.train_batch_size=4", "algorithm.rollout_n=4",
           "rollout.max_new_tokens=4", "trainer.threads_per_rank=1", f"checkpoint.dir={tmp_path / 'run'}",
           "checkpoint.keep_last=0", cwd=tmp_path, env={**ENV, "RL_SCORE_LOG": str(log)}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    train = [c for c in calls if c["rows"] == 16]
    assert [c["global_step"] for c in train][:4] == [0, 1, 2, 3], calls
    assert all(c["thread"].startswith("rl-score-ahead") for c in train[:4]), calls
    steps = rows(tmp_path / "run")
    for s in steps:
        scored = [c for c in train if c["global_step"] == s["step"] - 1][-1]
        assert s["reward_mean"] == pytest.approx(scored["mean"], abs=1e-6), (s["step"], scored)
    for s in steps:
        # the wait counts from the batch's arrival: never more than the scoring (how much it overlaps
        # the update depends on the machine's load; docs/async.md has the figures)
        assert s["timing"]["reward_ahead"] >= 0.4 and s["timing"]["reward"] <= s["timing"]["reward_ahead"] + 0.05, \
            s["timing"]


@pytest.mark.slow
def test_a_dead_rollout_worker_ends_the_run_with_the_resume_command(tmp_path):
    """SIGKILL the rollout worker once step_2 is saved (what the kernel's OOM killer does): the run
    exits 1 with one paragraph naming the dead RolloutWorker and `rl resume <dir>` (no traceback);
    that resume finishes the run, every step logged once."""
    import os
    import signal
    import subprocess

    import psutil

    from tests.cli_utils import _rl_argv, _rl_env
    from tests.ray_procs import wait_for

    run = tmp_path / "run"
    env = _rl_env(ENV)
    env.pop("RAY_ADDRESS", None)  # a private Ray in the run's own session: its rollout worker is found there
    p = subprocess.Popen(_rl_argv(["train", *TINY, "trainer.total_steps=16", "trainer.mode=one_step_off",
                                   "checkpoint.save_freq=2", f"checkpoint.dir={run}"], ""),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        wait_for(lambda: (run / "step_2" / "manifest.json").exists(), 600, "step_2's checkpoint", p, poll_s=0.05)
        workers = [q for q in psutil.process_iter(["cmdline"])
                   if "ray::RolloutWorker" in " ".join(q.info["cmdline"] or []) and os.getsid(q.pid) == p.pid]
        assert len(workers) == 1, workers
        os.kill(workers[0].pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    said = " ".join(out.replace("│", " ").split())
    assert p.returncode == 1, out[-3000:]
    assert f"RolloutWorker, pid {workers[0].pid}" in said and "died while rl waited for" in said, out[-3000:]
    assert f"continue with `rl resume {run}`" in said and "Traceback" not in out, out[-3000:]
    r = rl("resume", str(run), env=ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [x["step"] for x in rows(run)] == list(range(1, 17))
