"""The resume plan's checks one by one, on plain data (engine/checkpoint/resume_config.py and
resume_checks.py): each case here used to be reachable only through a whole checkpoint on disk.
No DCP, no Ray, no process group; the plan built from a real checkpoint is tests/test_resume.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from engine.checkpoint.optimizer_entries import OptimizerEntries
from engine.checkpoint.resume_checks import (backfill_warnings, model_mismatches, optimizer_coverage,
                                             prompt_set_refusal, rewind_warnings, rng_plan, row_files,
                                             trainer_position, verification_warnings, versions_changed)
from engine.checkpoint.resume_config import (checkpoint_dir_refusals, continuation_refusals,
                                             engine_override_refusals, resume_config)
from engine.config.schema import RunConfig

# ---- the config ---------------------------------------------------------------------------


def test_an_engine_override_is_refused_by_name_and_not_applied(tmp_path):
    """`engine=megatron` on an fsdp checkpoint is refused naming the engine that wrote it (and the
    way out); naming the same engine, or any other key, is simply applied."""
    applied, refusals = engine_override_refusals(
        ["engine=megatron", "trainer.total_steps=9", "engine.name=fsdp"], "fsdp", tmp_path / "step_3")
    assert applied == ["trainer.total_steps=9", "engine.name=fsdp"]
    assert len(refusals) == 1
    assert refusals[0].startswith("`engine=megatron`: the engine cannot change on resume; ")
    assert f"{tmp_path / 'step_3'} was written by the fsdp engine" in refusals[0]
    assert "checkpoint.dir=<new dir>" in refusals[0]


def test_checkpoint_dir_is_refused_only_when_it_names_another_directory(tmp_path):
    root = (tmp_path / "run").resolve()
    root.mkdir()
    assert checkpoint_dir_refusals(str(tmp_path / "elsewhere"), ["checkpoint.dir=x"], root) == [
        f"checkpoint.dir={tmp_path / 'elsewhere'}: resume continues in {root}; to branch the run, copy the "
        f"directory and resume the copy."]
    assert checkpoint_dir_refusals(str(root), [f"checkpoint.dir={root}"], root) == []
    # the saved checkpoint.dir (where the run was written) is not an override: never refused
    assert checkpoint_dir_refusals(str(tmp_path / "elsewhere"), ["trainer.total_steps=9"], root) == []


def test_resume_config_applies_allowed_changes_and_refuses_the_others(tmp_path):
    """The saved config plus overrides: total_steps changes, optim.lr is refused (the optimizer's
    state would silently win), checkpoint.dir becomes the run's own directory on both sides."""
    saved = RunConfig()
    conf = resume_config(saved, asdict(saved), ["trainer.total_steps=77", "optim.lr=0.5"], tmp_path,
                         tmp_path / "step_2")
    assert conf.cfg.trainer.total_steps == 77 and conf.cfg.optim.lr == 0.5
    assert conf.cfg.checkpoint.dir == saved.checkpoint.dir == str(tmp_path)
    by_key = {c.key: c for c in conf.changes}
    assert by_key["trainer.total_steps"].allowed and not by_key["optim.lr"].allowed
    assert by_key["optim.lr"].then == RunConfig().optim.lr and by_key["optim.lr"].now == 0.5
    assert len(conf.refusals) == 1 and conf.refusals[0].startswith("optim.lr cannot change on resume (")
    assert conf.applied == ["trainer.total_steps=77", "optim.lr=0.5"] and conf.warnings == []


def test_a_changed_key_read_from_the_environment_is_shown_as_written(tmp_path, monkeypatch):
    """An override reading ${oc.env:...} is printed and logged as its text, never its value."""
    monkeypatch.setenv("H45B_SECRET_LR", "0.25")
    saved = RunConfig()
    written = "${oc.decode:${oc.env:H45B_SECRET_LR}}"
    conf = resume_config(saved, asdict(saved), [f"optim.lr={written}"], tmp_path, tmp_path / "s")
    assert conf.cfg.optim.lr == 0.25
    (lr,) = [c for c in conf.changes if c.key == "optim.lr"]
    assert lr.now == written and "0.25" not in " ".join(conf.refusals)


def test_a_finished_run_is_refused_with_a_command_that_extends_it(tmp_path):
    cfg = RunConfig()
    cfg.trainer.total_steps = 10
    refusals = continuation_refusals(cfg, tmp_path, 10, cfg.engine.name, tmp_path / "step_10", Path("ckpt"))
    assert refusals == ["The checkpoint is at step 10 and trainer.total_steps is 10: nothing is left to run. "
                        "Extend the run: `rl resume ckpt trainer.total_steps=20`."]
    assert continuation_refusals(cfg, tmp_path, 9, cfg.engine.name, tmp_path / "step_9", Path("ckpt")) == []


def test_a_checkpoint_of_another_engine_is_refused(tmp_path):
    cfg = RunConfig()
    refusals = continuation_refusals(cfg, tmp_path, 1, "megatron", tmp_path / "step_1", Path("ckpt"))
    assert refusals == [f"{tmp_path / 'step_1'} was written by the megatron engine; the config says "
                        f"{cfg.engine.name}. Resume with the engine that wrote it."]


# ---- the checkpoint's contents ------------------------------------------------------------


def test_model_mismatches_name_missing_and_reshaped_parameters():
    params = {"a.w": {"shape": [4, 8]}, "b.w": {"shape": [2]}, "c.w": {"shape": [3]}}
    state = {"model.a.w": (4, 8), "model.b.w": (3,)}
    assert model_mismatches(params, state) == ["b.w (manifest [2], state [3])", "c.w (manifest [3], state [])"]
    assert model_mismatches({"a.w": {"shape": [4, 8]}}, state) == []


def _optimizer_case(drop: set[str]):
    """DCP names of an AdamW checkpoint of three parameters where b.w had no gradient yet (no state)."""
    every = ("a.w", "b.w", "c.w")
    names = {f"model.{p}" for p in every} | {f"optim.param_groups.{p}.lr" for p in every}
    names |= {f"optim.state.{p}.{k}" for p in ("a.w", "c.w") for k in ("step", "exp_avg", "exp_avg_sq")}
    return names - drop, {"model.a.w": (2,), "model.b.w": (2,), "model.c.w": (2,)}, \
        {"a.w": True, "b.w": False, "c.w": True}


def test_optimizer_coverage_backfills_parameters_that_had_no_state():
    names, model, param_state = _optimizer_case(set())
    cov = optimizer_coverage(names, model, param_state, False, Path("ckpt/step_1"))
    assert (cov.entries.loaded, cov.entries.backfilled, cov.entries.missing) == (["a.w", "c.w"], ["b.w"], [])
    assert cov.refusals == cov.warnings == []


def test_missing_optimizer_state_is_refused_unless_allow_partial():
    names, model, param_state = _optimizer_case({"optim.state.a.w.exp_avg", "optim.state.a.w.exp_avg_sq"})
    refused = optimizer_coverage(names, model, param_state, False, Path("ckpt/step_1"))
    assert refused.entries.missing == ["a.w"] and refused.warnings == []
    assert len(refused.refusals) == 1 and "a.w" in refused.refusals[0] and "--allow-partial" in refused.refusals[0]
    partial = optimizer_coverage(names, model, param_state, True, Path("ckpt/step_1"))
    assert partial.refusals == []
    assert partial.warnings == ["--allow-partial: 1 parameter(s) restart from the initial optimizer state although "
                                "the checkpoint says they had state: a.w."]


def test_a_new_rank_gets_a_seed_derived_generator_and_the_world_change_is_warned():
    plan = rng_plan(2, 3, ["rank_0.pt", "rank_1.pt"])
    assert [r["source"] for r in plan.ranks] == ["rng/rank_0.pt", "rng/rank_1.pt", None]
    assert plan.ranks[2]["note"] == "no saved RNG (rank did not exist at save, world size 2): seed-derived generator"
    assert plan.warnings == ["world size 2 -> 3: DCP reshards model and optimizer; per-rank sampling streams "
                             "differ, so the continuation is not bit-exact."]


def test_saved_rng_of_ranks_that_are_gone_is_named_as_unused():
    plan = rng_plan(3, 1, ["rank_2.pt", "rank_0.pt", "rank_1.pt"])
    assert [r["rank"] for r in plan.ranks] == [0]
    assert plan.warnings[1] == "saved RNG of ranks that no longer exist is not used: rank_1.pt, rank_2.pt."
    same = rng_plan(2, 2, ["rank_0.pt", "rank_1.pt"])
    assert same.warnings == [] and all(r["note"] == "" for r in same.ranks)


def test_verification_warnings_say_what_was_not_checked():
    assert "version 1" in verification_warnings(True, True, Path("s/manifest.json"))[0]
    assert verification_warnings(False, False, Path("m"))[0].startswith("--no-verify: file contents were NOT")
    assert verification_warnings(False, True, Path("m")) == []


def test_only_watched_package_versions_are_reported():
    changed, warnings = versions_changed({"torch": "2.1", "numpy": "1.0", "ray": "2.0"},
                                         {"torch": "2.2", "numpy": "2.0", "ray": "2.0"})
    assert changed == {"torch": ["2.1", "2.2"]}
    assert warnings == ["package versions differ from the run that wrote the checkpoint: torch 2.1 -> 2.2."]
    assert versions_changed({"torch": "2.1"}, {"torch": "2.1"}) == ({}, [])


def test_rewinding_names_the_checkpoints_set_aside():
    assert rewind_warnings([], 3) == []
    assert rewind_warnings(["step_4", "step_5"], 3) == [
        "rewinding: newer checkpoints step_4, step_5 are set aside as .superseded-<name>-* (not deleted) and metric "
        "rows after step 3 are dropped."]


# ---- the run directory and the data position ------------------------------------------------


def _row(step: int) -> str:
    return json.dumps({"step": step, "reward_mean": 0.5})


def test_row_files_name_torn_rows_carried_rows_and_lost_ones(tmp_path):
    """metrics.jsonl: step 1, a torn line, step 3; the checkpoint of step 4 carries step 4's row
    (rows.json), so step 2 is lost for good, step 4 is put back, the torn line dropped."""
    run, step_dir = tmp_path / "run", tmp_path / "run" / "step_4"
    step_dir.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(f"{_row(1)}\n{{\"step\": 2, \"rew\n{_row(3)}\n")
    (step_dir / "rows.json").write_text(json.dumps({"after_step": 3, "files": {"metrics.jsonl": [_row(4)]}}))
    rows = row_files(run, step_dir, 4)
    assert rows.rows_restored == {"metrics.jsonl": [4]}
    assert rows.warnings == [
        "metrics.jsonl line(s) 2 are not JSON rows (a write cut short by a kill): dropped on resume.",
        "metrics.jsonl lacks the row(s) of step(s) 4 or holds them cut short (a crash while they were written): "
        "put back from step_4/rows.json.",
        "metrics.jsonl has no row for step(s) 2 and step_4 does not carry them; those rows cannot be recomputed."]
    assert (run / "metrics.jsonl").read_text().count("\n") == 3  # read only: nothing rewritten


def test_row_files_of_a_run_without_metrics_warn_nothing(tmp_path):
    (tmp_path / "step_2").mkdir()
    rows = row_files(tmp_path, tmp_path / "step_2", 2)
    assert rows.rows_restored == {} and rows.warnings == []


def test_trainer_position_reads_samples_lr_and_data_position():
    state = {"samples_seen": 24, "lr_scheduler": {"last_epoch": 6, "_last_lr": [0.004, 0.001]},
             "data": {"epoch": 1, "index": 8, "samples_seen": 24, "n": 16, "seed": 0, "shuffle": True}}
    pos = trainer_position(state, {"samples_seen": 99})
    assert pos == {"samples_seen": 24, "lr_scheduler": {"last_epoch": 6, "last_lr": 0.004}, "data": state["data"]}
    assert trainer_position({}, {"samples_seen": 8}) == {
        "samples_seen": 8, "lr_scheduler": {"last_epoch": None, "last_lr": None}, "data": {}}


def test_a_data_position_on_another_prompt_set_is_refused():
    saved = {"epoch": 0, "index": 8, "samples_seen": 8, "n": 512, "seed": 0, "shuffle": True}
    assert prompt_set_refusal(saved, dict(saved, epoch=3, index=0)) is None  # the live position is not compared
    msg = prompt_set_refusal(saved, {"n": 500, "seed": 0, "shuffle": True})
    assert msg == ("The prompt set differs from the checkpoint's: saved {'n': 512, 'seed': 0, 'shuffle': True}, now "
                   "{'n': 500, 'seed': 0, 'shuffle': True} (the prompt file or task changed). The saved data position "
                   "would point at other prompts; resume with the original prompts.")


@pytest.mark.parametrize("allow_partial, reported, expected", [
    (False, [["b.w"], ["b.w"]], []),
    (True, [["a.w", "b.w"]], []),
    (False, [["a.w", "b.w"]], ["the ranks backfilled 2 parameter(s), the plan expected 1: ['a.w']"]),
])
def test_backfill_reported_by_the_ranks_is_compared_with_the_plan(allow_partial, reported, expected):
    entries = OptimizerEntries(loaded=[], backfilled=["b.w"], missing=["a.w"], skip=set(), reset=set())
    loaded = [{"optimizer": {"backfilled": r}} for r in reported]
    assert backfill_warnings(entries, allow_partial, loaded) == expected



def test_a_dcp_load_failure_names_what_is_missing(tmp_path):
    """A checkpoint lacking one of the critic's entries (which the manifest's plan does not cover)
    was refused with `CheckpointException ranks:dict_keys([0]) Traceback ...` cut at 600 characters,
    before the missing key's name."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from engine.checkpoint.restore import load_failure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"a": torch.zeros(2)}, checkpoint_id=str(tmp_path))
        with pytest.raises(CheckpointException) as e:
            dcp.load({"a": torch.zeros(2), "critic.optim.state.w.exp_avg": torch.zeros(2)}, checkpoint_id=str(tmp_path))
    said = load_failure(e.value)
    assert said == "RuntimeError: Missing key in checkpoint state_dict: critic.optim.state.w.exp_avg", said


@pytest.mark.parametrize("text,needle", [('{"trunc', "is not valid JSON. A save writes its manifest whole"),
                                         ("{}", "format None, not 'rl-checkpoint'"),
                                         ("[1]", "is not a JSON object")])
def test_a_damaged_manifest_says_so_once_and_names_the_checkpoint_before_it(tmp_path, text, needle):
    """A truncated manifest said "...the save that wrote it did not finish; pick another checkpoint.
    The checkpoint is damaged; resume an earlier one." (twice, and wrong: manifests are written
    atomically) without naming one; `{}` gave no fix at all."""
    from engine.checkpoint.layout import StepDir
    from engine.checkpoint.manifest import read_manifest
    from engine.errors import CheckpointError

    for s in ("step_1", "step_2"):
        (tmp_path / s).mkdir()
        (tmp_path / s / "manifest.json").write_text("{}")
    (tmp_path / "step_2" / "manifest.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        read_manifest(StepDir.at(tmp_path / "step_2"))
    assert needle in e.value.message and "did not finish" not in e.value.message
    assert e.value.message.endswith(f"The checkpoint before it: `rl resume {tmp_path / 'step_1'}`.")
