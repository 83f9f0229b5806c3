"""`rl resume`: exact, loud, reshardable resume with verified optimizer-state backfill.

Fast tests run torch DCP + DSD on a gloo world of 1 inside this process (the real FSDPEngine
checkpoint methods on a small FSDP2 module with a parameter that never gets a gradient) and
the CLI in-process. Slow tests run the real `rl train` / `rl resume` (Ray, gloo, 1-2 ranks),
compare final DCP states bit for bit, reshard 2->1 and 1->2, and SIGKILL runs mid-save.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from engine.checkpoint.find import find_checkpoint
from engine.checkpoint.optimizer_entries import classify_optimizer_entries, group_names
from engine.checkpoint.plan import plan_resume
from engine.checkpoint.restore import load_rank_state
from engine.checkpoint.run_files import truncate_jsonl
from engine.checkpoint.resume_rules import classify
from engine.errors import CheckpointError
from tests.ckpt_tools import reseal
from tests.cli_utils import rl_concurrently, rl as run_rl

TINY = ["trainer.total_steps=4", "checkpoint.save_freq=2", "data.train_batch_size=4", "algorithm.rollout_n=2"]


# ---- a small FSDP2 module with a parameter that never receives a gradient ---------------
class TwoHeads(nn.Module):
    """``unused`` joins the forward only when ``use_both`` is set (like an MoE expert that is
    not routed to, or an indexer whose output carries no gradient)."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.use_both = False

    def forward(self, x):
        y = self.used(x)
        return y + self.unused(x) if self.use_both else y


@pytest.fixture(scope="module")
def gloo1(tmp_path_factory):
    """A gloo process group of one rank in this process (DCP and DSD need one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _engine():
    """The real FSDPEngine checkpoint code around a fully_shard-ed TwoHeads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from engine.backends.fsdp import FSDPEngine
    from engine.backends.schedule import build_optimizer
    from engine.config.schema import RunConfig

    cfg = RunConfig()
    eng = FSDPEngine(cfg, "", 16, 0, 1, torch.device("cpu"), 1)
    torch.manual_seed(0)
    model = TwoHeads()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    eng.model = model
    eng.optimizer, eng._scheduler = build_optimizer(model.parameters(), cfg.optim, 10)
    return eng


def _step(eng, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    eng.model(x).pow(2).mean().backward()
    eng.optimizer.step()
    eng.optimizer.zero_grad(set_to_none=True)
    eng.lr_scheduler.step()


def _save(eng, run: Path, step: int) -> Path:
    """What RunDir.save writes, for a single rank (the slow tests use the real RunDir)."""
    from engine.checkpoint.save import finalize_checkpoint, prepare_tmp, rng_state, save_rank_state
    from engine.trainer.run_dir import RunDir

    if not (run / "run.json").exists():
        RunDir(run).create(eng.cfg, [], overwrite=False)
    prepare_tmp(run, step)
    files = save_rank_state(run, step, eng.checkpoint_state(), 0, rng_state(torch.Generator().manual_seed(7)))
    bs = 4  # prompts per step, as the saved config says (the data position must add up)
    config = asdict(eng.cfg)
    config["data"]["train_batch_size"] = bs
    manifest = {"samples_seen": bs * step, "world_size": 1, "engine": eng.cfg.engine.name,
                "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
                "model": {"preset": "tiny", "path": "", "num_params": 144, "params": eng.param_shapes()},
                "optimizer": {"type": "AdamW", "flattened": True, "param_state": eng.optimizer_coverage()},
                "config": config, "versions": {}}
    trainer = {"step": step, "samples_seen": bs * step,
               "data": {"epoch": 0, "index": bs * step, "samples_seen": bs * step, "n": 512, "seed": 0,
                        "shuffle": True},
               "lr_scheduler": eng.lr_scheduler.state_dict(), "learned_buckets": []}
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "reward_mean": 0.0}) + "\n")
    return finalize_checkpoint(run, step, trainer, manifest, files)


def _params(eng) -> dict:
    return {n: p.full_tensor().clone() for n, p in eng.model.named_parameters()}


def _drop_from_dcp(state_dir: Path, keys: set[str]) -> None:
    """Rewrite a DCP directory's .metadata without ``keys`` (DCP pickles it) and make the step's
    manifest agree with the new file (size, hash, digest): a checkpoint whose manifest claims
    state that its DCP directory does not hold (a writer that dropped entries, or a hand-edited
    checkpoint resealed to match)."""
    md_path = state_dir / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    assert keys <= set(md.state_dict_metadata), keys - set(md.state_dict_metadata)
    for k in keys:
        del md.state_dict_metadata[k]
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn not in keys}
    md_path.write_bytes(pickle.dumps(md))
    reseal(state_dir.parent)


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def _cli(*argv):
    from rlcli.main import app

    return CliRunner().invoke(app, list(argv), env={"COLUMNS": "200", "NO_COLOR": "1"})


# ---- fast: DSD backfill on a parameter that never got a gradient -------------------------
def test_flattened_load_needs_backfill_for_param_without_gradient(gloo1, tmp_path):
    """A parameter with no AdamW state at save time: plain DCP load fails (missing key, a
    BaseException), DCP's allow_partial_load then crashes inside DSD's flattened set_state_dict;
    load_rank_state backfills exactly those entries (manifest param_state false) and loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    a = _engine()
    _step(a, 1)
    _step(a, 2)
    step_dir = _save(a, tmp_path / "run", 2)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["optimizer"]["param_state"] == {"used.weight": True, "used.bias": True,
                                                    "unused.weight": False, "unused.bias": False}

    live = _engine().checkpoint_state()   # a fresh optimizer: DSD gives every parameter state
    assert "state.unused.weight.exp_avg" in live["optim"] and float(live["optim"]["state.unused.weight.step"]) == 1
    with pytest.raises(CheckpointException, match="unused.weight"):
        dcp.load(live, checkpoint_id=str(step_dir / "state"))
    b = _engine()
    partial = b.checkpoint_state()
    dcp.load(partial, checkpoint_id=str(step_dir / "state"), planner=DefaultLoadPlanner(allow_partial_load=True))
    partial["optim"] = {k: v for k, v in partial["optim"].items() if "unused" not in k or "param_groups" in k}
    with pytest.raises(TypeError, match="float"):
        b.load_checkpoint_state(partial)

    c = _engine()
    report = load_rank_state(step_dir, c, 0, torch.Generator(), {"allow_partial": False, "step": 2})
    assert report["optimizer"]["backfilled"] == ["unused.bias", "unused.weight"]
    assert report["optimizer"]["loaded"] == 2 and report["rng"] == "rng/rank_0.pt"
    assert all(torch.equal(_params(a)[k], v) for k, v in _params(c).items())
    sa, sc = a.optimizer.state[a.model.used.weight], c.optimizer.state[c.model.used.weight]
    assert torch.equal(sa["exp_avg"].full_tensor(), sc["exp_avg"].full_tensor()) and float(sc["step"]) == 2
    assert c.lr_scheduler.state_dict()["last_epoch"] == a.lr_scheduler.state_dict()["last_epoch"] == 2
    assert c._updates == 2, "the update count the learned bucket policy refreshes on continues"


def test_backfilled_parameter_first_update_is_bit_exact(gloo1, tmp_path):
    """After resume, the first update a backfilled parameter ever gets equals the uninterrupted
    run's: backfill resets DSD's initialised state (step 1) to AdamW's initial one (step 0)."""
    a = _engine()
    _step(a, 1)
    step_dir = _save(a, tmp_path / "run", 1)
    b = _engine()
    load_rank_state(step_dir, b, 0, torch.Generator(), {"allow_partial": False, "step": 1})
    assert float(b.optimizer.state[b.model.unused.weight]["step"]) == 0
    for e in (a, b):
        e.model.use_both = True
        _step(e, 5)
        _step(e, 6)
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["unused.weight"], _params(_engine())["unused.weight"])  # it did move


def test_deleted_optimizer_entry_is_refused_then_backfilled_with_allow_partial(gloo1, tmp_path):
    """An entry the manifest says exists but the checkpoint lacks is refused (naming the
    parameter) by both the plan and every rank; --allow-partial backfills it and says so."""
    a = _engine()
    _step(a, 1)
    step_dir = _save(a, tmp_path / "run", 1)
    _drop_from_dcp(step_dir / "state", {"optim.state.used.weight.exp_avg", "optim.state.used.weight.exp_avg_sq"})

    plan = plan_resume(tmp_path / "run", ["trainer.total_steps=5"])
    assert plan.optimizer.missing == ["used.weight"] and plan.optimizer.backfilled == ["unused.bias", "unused.weight"]
    with pytest.raises(CheckpointError, match="used.weight.*--allow-partial"):
        plan.raise_if_refused()
    with pytest.raises(CheckpointError, match="used.weight"):
        load_rank_state(step_dir, _engine(), 0, None, {"allow_partial": False, "step": 1})

    ok = plan_resume(tmp_path / "run", ["trainer.total_steps=5"], allow_partial=True)
    ok.raise_if_refused()
    assert any(w.startswith("--allow-partial") and "used.weight" in w for w in ok.warnings)
    b = _engine()
    rep = load_rank_state(step_dir, b, 0, None, {"allow_partial": True, "step": 1})
    assert "used.weight" in rep["optimizer"]["backfilled"]
    st = b.optimizer.state[b.model.used.weight]
    assert float(st["step"]) == 0 and not st["exp_avg"].full_tensor().any()
    assert torch.equal(_params(b)["used.weight"], _params(a)["used.weight"])  # weights still loaded

    r = _cli("resume", str(tmp_path / "run"), "trainer.total_steps=5", "--dry-run")
    assert r.exit_code == 2 and "missing (refused)" in r.output and "allow-partial" in r.output
    r = _cli("resume", str(tmp_path / "run"), "trainer.total_steps=5", "--dry-run", "--allow-partial")
    assert r.exit_code == 0 and "MISSING, backfilled by --allow-partial" in r.output


def test_optimizer_entry_classification_for_both_engine_layouts():
    """FSDP (DSD) checkpoints omit state of gradient-less parameters; Megatron's write an
    initial-state template for them. Both are backfilled (never read) when param_state is
    false; a true parameter lacking any entry is missing."""
    fqns = {"a.w", "b.w"}
    expected = [f"state.{p}.{n}" for p in sorted(fqns) for n in ("step", "exp_avg")] + \
               [f"param_groups.{p}.lr" for p in sorted(fqns)]
    dsd = {"state.a.w.step", "state.a.w.exp_avg", "param_groups.a.w.lr", "param_groups.b.w.lr"}
    e = classify_optimizer_entries(expected, dsd, {"a.w": True, "b.w": False}, fqns)
    assert (e.loaded, e.backfilled, e.missing) == (["a.w"], ["b.w"], [])
    assert e.skip == e.reset == {"state.b.w.step", "state.b.w.exp_avg"}
    megatron = set(expected)
    e = classify_optimizer_entries(expected, megatron, {"a.w": True, "b.w": False}, fqns)
    assert e.backfilled == ["b.w"] and e.skip == {"state.b.w.step", "state.b.w.exp_avg"}
    e = classify_optimizer_entries(expected, dsd - {"state.a.w.exp_avg"}, {"a.w": True, "b.w": False}, fqns)
    assert e.missing == ["a.w"] and e.skip == {"state.a.w.exp_avg", "state.b.w.step", "state.b.w.exp_avg"}
    assert group_names([f"model.layers.{i}.mlp.weight" for i in range(12)] + ["lm_head.weight"]) == \
        ["model.layers.*.mlp.weight (x12: 0-11)", "lm_head.weight"]


# ---- fast: finding checkpoints and refusing ---------------------------------------------
@pytest.fixture(scope="module")
def small_run(gloo1, tmp_path_factory) -> Path:
    """A run directory with complete step_1 and step_2 (TwoHeads, real DCP)."""
    run = tmp_path_factory.mktemp("small") / "run"
    e = _engine()
    _step(e, 1)
    _save(e, run, 1)
    _step(e, 2)
    _save(e, run, 2)
    return run


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_latest_complete_checkpoint_is_chosen_from_disk(small_run, tmp_path):
    """"Latest" is the highest complete step_N on disk; a .tmp-step_N (an interrupted save) is
    skipped and listed; a newer step_N without manifest (which no save leaves: a partial copy, or
    damage) is refused, naming the complete one to pass explicitly, which then skips it; naming an
    older step_N rewinds (newer set aside)."""
    from engine.errors import CheckpointError

    run = _copy(small_run, tmp_path / "run")
    (run / ".tmp-step_4").mkdir()
    loc = find_checkpoint(run)
    assert loc.step.step == 2 and loc.skipped == [".tmp-step_4"]
    shutil.copytree(run / "step_2", run / "step_3")
    (run / "step_3" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"newer checkpoint directories without a manifest.json \(step_3\).*"
                                              r"copied partially.*`rl resume .*step_2`"):
        find_checkpoint(run)
    loc = find_checkpoint(run / "step_2")
    assert loc.step.step == 2 and loc.skipped == ["step_3"]
    shutil.rmtree(run / "step_3")
    plan = plan_resume(run, ["trainer.total_steps=6"])
    assert plan.step == 2 and plan.samples_seen == 8 and plan.refusals == []
    older = plan_resume(run / "step_1", ["trainer.total_steps=6"])
    assert older.step == 1 and older.later_checkpoints == ["step_2"] and older.metrics_rows_dropped == 1
    assert any("rewinding" in w for w in older.warnings)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")  # killed before step 2's row landed
    assert any("no row for step(s) 2" in w for w in plan_resume(run, ["trainer.total_steps=6"]).warnings)


@pytest.mark.parametrize("case", ["missing", "empty", "run_without_checkpoint", "only_incomplete", "tmp_dir",
                                  "incomplete_step", "finished", "refused_override", "unknown_key", "corrupt",
                                  "engine_changed", "other_dir"])
def test_refusals_exit_2_and_modify_nothing(small_run, tmp_path, case):
    """Every unusable path or command is refused with exit 2, a message naming the problem and
    the fix, no traceback, and not one file changed; nothing ever starts from step 0."""
    run = _copy(small_run, tmp_path / "run")
    target, extra, expect = run, [], ""
    if case == "missing":
        target, expect = tmp_path / "nope", "does not exist"
    elif case == "empty":
        target = tmp_path / "empty"
        target.mkdir()
        expect = "not an rl checkpoint (no run.json"
    elif case == "run_without_checkpoint":
        for s in ("step_1", "step_2"):
            shutil.rmtree(run / s)
        (run / ".tmp-step_1").mkdir()
        expect = "has not written a checkpoint yet"
    elif case == "only_incomplete":
        for s in ("step_1", "step_2"):
            (run / s / "manifest.json").unlink()
        expect = "only incomplete checkpoints"
    elif case == "tmp_dir":
        os.replace(run / "step_2", run / ".tmp-step_2")
        target, expect = run / ".tmp-step_2", "never finished"
    elif case == "incomplete_step":
        (run / "step_2" / "manifest.json").unlink()
        target, expect = run / "step_2", "step_1"
    elif case == "finished":
        extra, expect = ["trainer.total_steps=2"], "nothing is left to run"
    elif case == "refused_override":
        extra, expect = ["trainer.total_steps=9", "model.hidden_size=32"], "model.hidden_size cannot change"
    elif case == "unknown_key":
        extra, expect = ["trainer.total_step=9"], "total_steps"
    elif case == "corrupt":
        with open(run / "step_2" / "state" / "__0_0.distcp", "ab") as f:
            f.write(b"x")
        expect = "does not match its manifest"
    elif case == "engine_changed":
        extra, expect = ["trainer.total_steps=9", "engine.name=megatron"], "engine cannot change"
    elif case == "other_dir":
        extra, expect = ["trainer.total_steps=9", f"checkpoint.dir={tmp_path / 'elsewhere'}"], "copy"
    before = _snapshot(tmp_path)
    r = _cli("resume", str(target), *extra)
    assert r.exit_code == 2, r.output
    assert expect in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output
    assert _snapshot(tmp_path) == before


def test_config_change_rule():
    """Run length, ranks, cadence and memory layout may change; what defines the experiment, or
    what the checkpoint restores anyway (optim.*), is refused; unknown keys are refused."""
    for key in ("trainer.total_steps", "trainer.nprocs", "trainer.log_freq", "trainer.val_freq",
                "checkpoint.save_freq", "checkpoint.keep_last", "engine.param_offload", "engine.micro_batch_size"):
        assert classify(key)[0], key
    for key in ("model.hidden_size", "model.path", "engine.name", "algorithm.rollout_n", "data.train_batch_size",
                "optim.lr", "trainer.seed", "task.name", "rollout.temperature", "checkpoint.dir", "brand.new_key"):
        assert not classify(key)[0], key
    assert "silently ignored" in classify("optim.lr")[1]


def test_dry_run_json_is_the_plan(small_run):
    """--dry-run --json prints the plan on stdout: step, optimizer coverage, RNG per rank, world
    sizes and each config change marked allowed or refused."""
    r = _cli("resume", str(small_run), "trainer.total_steps=8", "trainer.nprocs=2", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["step"] == 2 and plan["start_step"] == 2 and plan["total_steps"] == 8
    assert plan["optimizer"] == {"loaded": 2, "backfilled": ["unused.bias", "unused.weight"], "missing": [],
                                 "allow_partial": False}
    assert [x["source"] for x in plan["rng"]] == ["rng/rank_0.pt", None]
    assert (plan["world_size_then"], plan["world_size_now"]) == (1, 2)
    assert {c["key"]: c["allowed"] for c in plan["config_changes"]} == {"trainer.total_steps": True,
                                                                        "trainer.nprocs": True}
    assert "error" not in plan
    # a refused plan follows the --json error convention: "error" (the panel's title and message, the
    # exit code), the plan's keys beside it; the panel on stderr, exit 2
    r = _cli("resume", str(small_run), "trainer.total_steps=8", "optim.lr=1", "--dry-run", "--json")
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["error"]["title"] == "cannot resume" and doc["error"]["exit_code"] == 2, doc
    assert "optim.lr cannot change on resume" in doc["error"]["message"] and doc["refusals"], doc
    assert doc["step"] == 2 and "cannot resume" in r.stderr


def test_dry_run_table_groups_rng_ranks_at_any_world_size(small_run):
    """The plan keeps RNG per rank, but the table shows one row per run of ranks restored the
    same way: a resume onto many ranks is a few lines, not one row each (rendering one row per
    rank took minutes at tens of thousands of ranks)."""
    # 8 ranks (this run's 4 prompts x 8 samples feed at most 32: a rank with no sequence to train on
    # is refused since the audit of 2026-12-02, so 4096 ranks would need 4096 sequences per update)
    r = _cli("resume", str(small_run), "trainer.total_steps=8", "trainer.nprocs=8", "--dry-run")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "rank 0: rng/rank_0.pt" in out and "ranks 1-7: no saved RNG" in out, out
    assert "rank 7:" not in out and len(out.splitlines()) < 80
    r = _cli("resume", str(small_run), "trainer.total_steps=8", "trainer.nprocs=2", "--dry-run")
    assert "rank 1: no saved RNG" in r.output  # a run of one rank is named as the rank

def test_truncate_jsonl_drops_rows_after_step(tmp_path):
    """metrics/memory rows after the resumed step are dropped (they will be recomputed)."""
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": 1}) + "\n" for s in (1, 2, 3, 3, 4)))
    assert truncate_jsonl(p, 2) == 3
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2]


# ---- slow: the real thing ---------------------------------------------------------------
RL_ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}


def rl(*args, timeout=900):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, timeout=timeout, env=RL_ENV)


def dcp_tensors(state_dir: Path) -> dict:
    """Every entry of a DCP directory as one flat dict (values loaded)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = state_dir.parent / "flat.pt"
    dcp_to_torch_save(str(state_dir), str(out))
    sd = torch.load(out, weights_only=False)
    out.unlink()
    return {f"{top}.{k}": v for top, d in sd.items() for k, v in d.items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def stopped_after(src: Path, dst: Path, step: int) -> Path:
    """``src`` as it was when stopped right after saving ``step``: later checkpoints gone
    (their metric rows are left behind, as a kill between steps leaves them)."""
    shutil.copytree(src, dst)
    for p in dst.glob("step_*"):
        if int(p.name.split("_")[1]) > step:
            shutil.rmtree(p)
    return dst


@pytest.fixture(scope="module")
def straights(tmp_path_factory) -> tuple[Path, Path]:
    """The two straight runs, started together (independent runs, each in its own directory):
    see straight1 and straight2."""
    d1 = tmp_path_factory.mktemp("straight1") / "run"
    d2 = tmp_path_factory.mktemp("straight2") / "run"
    r1, r2 = rl_concurrently(["train", *TINY, "task.num_train=8", f"checkpoint.dir={d1}", "checkpoint.keep_last=0"],
                             ["train", *TINY, "trainer.nprocs=2", f"checkpoint.dir={d2}", "checkpoint.keep_last=0"],
                             timeout=900, env=RL_ENV)
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert r2.returncode == 0, r2.stderr[-3000:]
    return d1, d2


@pytest.fixture(scope="module")
def straight1(straights) -> Path:
    """1 rank, 4 steps, 8 prompts of 4 per step: step 2 ends exactly at an epoch boundary."""
    return straights[0]


@pytest.fixture(scope="module")
def straight2(straights) -> Path:
    """2 ranks, 4 steps."""
    return straights[1]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_resume_is_bit_exact(straight1, straight2, tmp_path, ranks):
    """4 steps straight == 2 steps, stop, `rl resume`, 2 more: identical final model and
    optimizer state (every DCP entry) and identical reward/pg_loss/entropy rows. With 1 rank the
    resume point is an epoch boundary."""
    src = straight1 if ranks == 1 else straight2
    run = stopped_after(src, tmp_path / "run", 2)
    r = rl("resume", str(run), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rl resume" in r.stderr and json.loads(r.stdout)["first_step"] == 3
    assert_same_state(dcp_tensors(src / "step_4" / "state"), dcp_tensors(run / "step_4" / "state"))
    got, want = metrics(run), metrics(src)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for key in ("reward_mean", "pg_loss", "entropy", "grad_norm", "lr"):
        assert [m[key] for m in got] == [m[key] for m in want], key
    if ranks == 1:
        assert json.loads((run / "step_4" / "trainer.json").read_text())["data"]["epoch"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_resume_reshards_world_size(straight1, straight2, tmp_path, direction):
    """A checkpoint saved at world size 2 resumes at 1 and vice versa; the plan says so, new
    ranks have no RNG file, and training continues from the same policy (entropy of the first
    resumed step within 0.05 of the uninterrupted run's)."""
    src, now = (straight2, 1) if direction == "2->1" else (straight1, 2)
    run = stopped_after(src, tmp_path / "run", 2)
    plan = json.loads(_cli("resume", str(run), f"trainer.nprocs={now}", "--dry-run", "--json").stdout)  # driver only: in process
    assert (plan["world_size_then"], plan["world_size_now"]) == (3 - now, now)
    if now == 2:
        assert plan["rng"][1]["source"] is None
    r = rl("resume", str(run), f"trainer.nprocs={now}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "step_4" / "manifest.json").read_text())["world_size"] == now
    got, want = metrics(run), metrics(src)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert abs(got[2]["entropy"] - want[2]["entropy"]) < 0.05, (got[2]["entropy"], want[2]["entropy"])


def _reload_and_resave(rank: int, world: int, step_dir: str, out_dir: str) -> None:
    """Inside a gloo rank: build the run's engine at this world size, load_rank_state, save."""
    import torch.distributed.checkpoint as dcp

    from engine.backends.fsdp import FSDPEngine
    from engine.checkpoint.restore import load_rank_state
    from engine.config.load import config_from_dict
    from engine.trainer.setup import prepare_inputs

    manifest = json.loads((Path(step_dir) / "manifest.json").read_text())
    cfg = config_from_dict(manifest["config"])
    cfg.trainer.nprocs = world
    inputs = prepare_inputs(cfg)
    v = inputs.vocab
    eng = FSDPEngine(cfg, inputs.model_path, v["size"], v["pad"], v["eos"], torch.device("cpu"), 1)
    torch.manual_seed(cfg.trainer.seed)
    eng.build()
    load_rank_state(Path(step_dir), eng, rank, torch.Generator(), {"allow_partial": False,
                                                                  "step": manifest["step"]})
    dcp.save(eng.checkpoint_state(), checkpoint_id=out_dir)


def _rank_entry(rank: int, world: int, store: str, fn, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.dist_utils import exit_after_barrier

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    fn(rank, world, *args)
    exit_after_barrier()


@pytest.mark.slow
def test_dcp_reshard_restores_every_entry_exactly(straight1, straight2, tmp_path):
    """Loading a 2-rank checkpoint on 1 rank (and a 1-rank one on 2) and saving it again gives
    the same DCP content bit for bit: parameters and every AdamW entry survive resharding."""
    from tests.dist_utils import start_ranks

    for src, world, name in ((straight2, 1, "2to1"), (straight1, 2, "1to2")):
        out = tmp_path / name
        start_ranks(_rank_entry, (world, str(tmp_path / f"{name}.store"), _reload_and_resave,
                                  (str(src / "step_2"), str(out))), world)
        assert_same_state(dcp_tensors(src / "step_2" / "state"), dcp_tensors(out))


def _session_pids(sid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                out.append(int(p.name))
    return out


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the run and everything it started (Ray's processes share its session)."""
    proc.kill()  # SIGKILL, unless the run already ended and was reaped (wait_for's poll): then its pid may be another's
    proc.wait()
    deadline = time.time() + 60
    while (left := _session_pids(proc.pid)) and time.time() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert not _session_pids(proc.pid)


def start(*args, log: Path) -> subprocess.Popen:
    """A run to SIGKILL: on its own private Ray (not the session's head, tests/conftest.py), so
    that its ranks are in its session and die with it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", NO_COLOR="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "rlcli.main", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_for(pred, proc: subprocess.Popen, timeout: float = 600, poll: float = 0.002):
    deadline = time.time() + timeout
    while time.time() < deadline:
        hit = pred()
        if hit:
            return hit
        if proc.poll() is not None:
            return None
        time.sleep(poll)
    return None


def tmp_save_at_least(run: Path, step: int):
    def pred():
        try:
            names = os.listdir(run)
        except FileNotFoundError:
            return None
        hits = [n for n in names if n.startswith(".tmp-step_") and int(n.rsplit("_", 1)[1]) >= step]
        return hits[0] if hits else None
    return pred


@pytest.mark.slow
def test_sigkill_mid_save_and_mid_step_then_resume(tmp_path):
    """SIGKILL a real run (a) mid-step after step_2 is saved, (b) while the resumed run writes
    .tmp-step_N; each time `rl resume` picks the previous complete checkpoint (the half-written
    one is skipped) and the final run has every step once and a complete last checkpoint."""
    run = tmp_path / "run"
    args = ["trainer.total_steps=6", "checkpoint.save_freq=1", "data.train_batch_size=4", "algorithm.rollout_n=2",
            f"checkpoint.dir={run}"]
    p = start("train", *args, log=tmp_path / "train.log")
    try:
        # killed as soon as step_2 is complete: wherever the kill lands (finishing the save, or in
        # step 3), step_2 must be what resume finds
        assert wait_for(lambda: (run / "step_2" / "manifest.json").exists(), p), (tmp_path / "train.log").read_text()
    finally:
        kill9(p)
    latest = find_checkpoint(run).step.step
    assert latest >= 2

    kills = 0
    for attempt in range(3):   # a save can finish between seeing .tmp-step_N and the kill landing
        p = start("resume", str(run), log=tmp_path / f"resume{attempt}.log")
        try:
            hit = wait_for(tmp_save_at_least(run, latest + 1), p)
        finally:
            kill9(p)
        if hit and (run / hit).exists():
            kills += 1
            before = find_checkpoint(run)
            assert before.step.step < int(hit.rsplit("_", 1)[1]) and hit in before.skipped
            plan = plan_resume(run)
            assert plan.refusals == [] and plan.step == before.step.step
            break
        latest = find_checkpoint(run).step.step
    assert kills == 1, "never caught a save in progress"

    r = rl("resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert (run / "step_6" / "manifest.json").exists()
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert not list(run.glob(".tmp-step_*"))


@pytest.mark.slow
def test_deleted_entry_in_real_checkpoint_refused_then_allow_partial(straight1, tmp_path):
    """On a real `rl train` checkpoint, a deleted lm_head AdamW entry is refused by `rl resume`
    (exit 2, names lm_head.weight, nothing modified); --allow-partial resumes, says so in red
    and records the backfilled parameter in resumes.jsonl."""
    run = stopped_after(straight1, tmp_path / "run", 2)
    _drop_from_dcp(run / "step_2" / "state", {"optim.state.lm_head.weight.exp_avg"})
    before = _snapshot(run)
    r = rl("resume", str(run), "trainer.total_steps=3")
    assert r.returncode == 2 and "lm_head.weight" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert _snapshot(run) == before
    r = rl("resume", str(run), "trainer.total_steps=3", "--allow-partial")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MISSING, backfilled by --allow-partial" in r.stdout
    log = json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])
    assert log["loaded"][0]["optimizer"]["backfilled"] == ["lm_head.weight"]
    assert (run / "step_3" / "manifest.json").exists()


@pytest.mark.slow
def test_model_that_differs_from_checkpoint_is_refused_by_the_ranks(straight1, tmp_path):
    """If the model the config builds differs from the checkpoint's (here: the saved config
    edited behind rl's back, manifest resealed so verification passes), the ranks refuse before
    loading anything: exit 2, the differing shapes named, no file modified."""
    run = stopped_after(straight1, tmp_path / "run", 2)
    man_path = run / "step_2" / "manifest.json"
    man = json.loads(man_path.read_text())
    man["config"]["model"]["intermediate_size"] = 96
    man_path.write_text(json.dumps(man))
    reseal(run / "step_2")
    before = _snapshot(run)
    r = rl("resume", str(run), "trainer.total_steps=3")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "different model" in " ".join(r.stderr.split()) and "mlp" in r.stderr
    assert _snapshot(run) == before


# ---- slow: the same load path on the Megatron engine's optimizer layout ------------------
def _megatron_session(rank: int, world: int, workdir: str) -> None:
    """One gloo rank: a MegatronEngine (TP=1) takes a step and is checkpointed; then the
    checkpoint is edited and reloaded into fresh engines through load_rank_state."""
    import warnings

    warnings.filterwarnings("ignore")
    from engine.backends.megatron.engine import MegatronEngine
    from engine.batch import SequenceBatch
    from engine.config.schema import MegatronEngineConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig

    cfg = RunConfig(trainer=TrainerConfig(total_steps=4, seed=3),
                    model=ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32),
                    optim=OptimConfig(lr=1e-3, warmup_steps=0),
                    engine=MegatronEngineConfig(max_tokens_per_micro_batch=64))

    def engine():
        e = MegatronEngine(cfg, "", 41, 0, 1, torch.device("cpu"), 1)
        e.build()
        return e

    class Loss:
        needs_entropy = False

        def __call__(self, lp, ent, mb, n_tokens, n_seqs):
            loss = -(mb.advantages * lp * mb.response_mask).sum() / n_tokens
            return loss, {"pg_loss": float(loss)}

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 41, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    resp = (torch.arange(12)[None] >= 3).float().expand(4, 12).contiguous()
    batch = SequenceBatch(input_ids=ids, attention_mask=attn, response_mask=resp,
                          prompt_lengths=torch.full((4,), 3), advantages=torch.randn(4, 1, generator=g).expand(4, 12)
                          * resp)
    a = engine()
    a.train_step(batch, Loss())
    run = Path(workdir) / "run"
    step_dir = _save(a, run, 1)
    names = sorted(a.optimizer_coverage())
    backfilled, damaged = names[-1], names[0]
    man = json.loads((step_dir / "manifest.json").read_text())
    man["optimizer"]["param_state"][backfilled] = False   # as if it had had no gradient yet
    (step_dir / "manifest.json").write_text(json.dumps(man))
    out = {"names": names, "backfilled": backfilled, "damaged": damaged}

    b = engine()
    rep = load_rank_state(step_dir, b, rank, None, {"allow_partial": False, "step": 1})
    out["report"] = rep["optimizer"]
    out["weights_exact"] = all(torch.equal(v, a.export_hf_state_dict()[k]) for k, v in b.export_hf_state_dict().items())
    sa, sb = a.checkpoint_state()["optim"], b.checkpoint_state()["optim"]
    out["loaded_exact"] = all(torch.equal(sa[k], sb[k]) for k in sa if k.startswith("state.")
                              and backfilled not in k and isinstance(sa[k], torch.Tensor))
    out["backfilled_initial"] = all(not sb[k].any() for k in sb if k.startswith(f"state.{backfilled}."))

    _drop_from_dcp(step_dir / "state", {f"optim.state.{damaged}.exp_avg"})
    try:
        load_rank_state(step_dir, engine(), rank, None, {"allow_partial": False, "step": 1})
        out["refused"] = None
    except CheckpointError as e:
        out["refused"] = e.message
    rep = load_rank_state(step_dir, engine(), rank, None, {"allow_partial": True, "step": 1})
    out["partial"] = rep["optimizer"]
    torch.save(out, Path(workdir) / "megatron.pt")


@pytest.mark.slow
@pytest.mark.megatron
def test_backfill_and_refusal_on_megatron_optimizer_layout(tmp_path):
    """The same rank-side load on the Megatron engine (which writes an initial-state template
    for gradient-less parameters): a param_state-false parameter is backfilled to the initial
    state, everything else loads bit-exactly, a deleted entry is refused by name and accepted
    with allow_partial."""
    pytest.importorskip("megatron.core")
    from tests.dist_utils import start_ranks

    start_ranks(_rank_entry, (1, str(tmp_path / "store"), _megatron_session, (str(tmp_path),)), 1)
    r = torch.load(tmp_path / "megatron.pt", weights_only=False)
    assert r["report"]["backfilled"] == [r["backfilled"]]
    assert r["report"]["loaded"] == len(r["names"]) - 1
    assert r["weights_exact"] and r["loaded_exact"] and r["backfilled_initial"]
    assert r["refused"] and r["damaged"] in r["refused"] and "--allow-partial" in r["refused"]
    assert sorted(r["partial"]["backfilled"]) == sorted([r["backfilled"], r["damaged"]])


def test_checkpoint_paths_that_are_not_directories_are_named(tmp_path):
    """`rl resume` and `rl export` name what a bad checkpoint path is (a symlink loop, a FIFO, a
    device) instead of calling a loop missing or a FIFO a file; exit 2, nothing opened."""
    import os

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    os.mkfifo(tmp_path / "fifo")
    for target, expect in ((tmp_path / "a", "loops through symbolic links"), (tmp_path / "fifo", "is a FIFO"),
                           (Path("/dev/zero"), "is a device")):
        for argv in (["resume", str(target), "--dry-run"], ["export", str(target), "--out", str(tmp_path / "o")]):
            r = _cli(*argv)
            assert r.exit_code == 2 and expect in " ".join(r.output.split()), (argv, r.output)
            assert "Traceback" not in r.output and not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_run_files_that_are_not_regular_files_are_refused(small_run, tmp_path, kind):
    """metrics.jsonl is appended to when a run continues: as a FIFO the write would wait forever,
    as a symlink the rows would go wherever it points (another user's file). Resume, dry or real,
    refuses with exit 2 naming the file, and the file it points at is untouched."""
    import os

    run = _copy(small_run, tmp_path / "run")
    metrics = run / "metrics.jsonl"
    outside = tmp_path / "victim.txt"
    outside.write_text("keep me\n")
    if metrics.exists():
        metrics.unlink()
    {"fifo": lambda: os.mkfifo(metrics), "symlink": lambda: metrics.symlink_to(outside),
     "directory": lambda: metrics.mkdir()}[kind]()
    for extra in (["--dry-run"], []):
        r = _cli("resume", str(run), "trainer.total_steps=4", *extra)
        assert r.exit_code == 2 and "metrics.jsonl is a" in " ".join(r.output.split()), r.output
    assert outside.read_text() == "keep me\n"


def test_the_manifest_records_the_optimizer_the_engine_really_has():
    """The manifest's optimizer type comes from the engine (it was the literal "AdamW" written by
    the trainer whatever ran); the checkpoint package alone builds the manifest body."""
    from engine.checkpoint.manifest import RunManifest, run_manifest
    from engine.config.load import load_run_config

    cfg = load_run_config([]).config
    facts = {"optimizer_type": "SGD", "param_state": {"w": True}, "params": {"w": {"shape": [2], "dtype": "float32"}},
             "num_params": 2, "lora": None}
    m = run_manifest(cfg, samples_seen=8, world_size=2, dp_size=2, facts=facts, resolved_model_path="",
                     saved_config={"k": 1}, versions={})
    assert isinstance(m, RunManifest)
    j = m.to_json()
    assert j["optimizer"] == {"type": "SGD", "flattened": True, "param_state": {"w": True}}
    assert j["parallel"] == {"dp": 2, "tp": 1, "pp": 1, "cp": 1} and j["engine"] == "fsdp" and "lora" not in j["model"]


@pytest.mark.slow
def test_a_real_runs_manifest_records_adamw(straight1):
    """The same through a real `rl train` (the straight 1-rank run this module's resume tests
    share, which trained its own run for this before): every checkpoint's manifest names the
    optimizer the FSDP engine built, AdamW."""
    steps = sorted(straight1.glob("step_*"))
    assert [p.name for p in steps] == ["step_2", "step_4"]
    for step in steps:
        assert json.loads((step / "manifest.json").read_text())["optimizer"]["type"] == "AdamW", step
