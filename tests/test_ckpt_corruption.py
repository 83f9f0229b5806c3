"""Damaged and crafted `rl` checkpoints: every kind is detected by `rl resume` and by
`rl inspect-ckpt --verify` with exit 2, no traceback, and the run directory left exactly as it
was (every path, size, mtime and content hashed before and after); nothing in a checkpoint
runs code.

One real checkpoint is made per module (`rl train`, 2 steps, 1 rank) and copied per case.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.ckpt_tools import edit_manifest, plant_code_in_shard, reseal, tree_state
from tests.cli_utils import rl as run_rl

pytestmark = pytest.mark.slow

STEP = "step_2"


def rl(*args, timeout=900):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, timeout=timeout, env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def trained(small_run) -> Path:
    """The suite's shared small run (tests/conftest.py): every test here copies it before damaging."""
    assert (small_run / STEP / "manifest.json").is_file()
    return small_run


def cli(*argv):
    from rlcli.main import app

    return CliRunner().invoke(app, list(argv), env={"COLUMNS": "200", "NO_COLOR": "1"})


def flip_bits(path: Path, where: float = 0.5, n: int = 3) -> None:
    """Same-size damage: flip one bit in each of ``n`` bytes around ``where`` of the file."""
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    for i in range(n):
        data[at + 7 * i] ^= 1 << i
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float | int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])


def _all_optimizer_absent(m: dict) -> None:
    m["optimizer"]["param_state"] = {k: False for k in m["optimizer"]["param_state"]}


def _data_position(index: int):
    def edit(step: Path) -> None:
        tj = step / "trainer.json"
        t = json.loads(tj.read_text())
        t["data"]["index"] = index
        tj.write_text(json.dumps(t, indent=2))
    return edit


def _symlink_to_copy(rel: str):
    def damage(step: Path, outside: Path) -> None:
        src = step / rel
        copy = outside / Path(rel).name
        if src.is_dir():
            shutil.copytree(src, copy)
            shutil.rmtree(src)
        else:
            shutil.copy2(src, copy)
            src.unlink()
        src.symlink_to(copy)  # identical bytes, reached through a link
    return damage


def _garbage_rng(step: Path, outside: Path) -> None:
    (step / "rng" / "rank_0.pt").write_bytes(os.urandom(4096))
    reseal(step)


def _fifo(rel: str):
    def damage(step: Path, outside: Path) -> None:
        (step / rel).unlink()
        os.mkfifo(step / rel)
    return damage


def _forged_tensor_size(step: Path, outside: Path) -> None:
    """.metadata claims a weight of 10^14 elements (its chunk too), manifest resealed: what the
    metadata says it stores is far too little for that, so the claim is refused before anything
    sizes a buffer from it."""
    import pickle

    import torch

    meta = step / "state" / ".metadata"
    md = pickle.loads(meta.read_bytes())  # the test's own trusted copy
    name = next(k for k, v in md.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size"))
    entry = md.state_dict_metadata[name]
    entry.size = torch.Size([10**7, 10**7])
    entry.chunks[0].sizes = entry.size
    meta.write_bytes(pickle.dumps(md))
    reseal(step)


# name -> damage(step_dir, a directory outside the run); every one must be refused
CASES = {
    # truncations
    "truncated shard": lambda s, o: truncate(s / "state" / "__0_0.distcp", 0.5),
    "truncated .metadata": lambda s, o: truncate(s / "state" / ".metadata", 0.9),
    "truncated rng file": lambda s, o: truncate(s / "rng" / "rank_0.pt", 100),
    "truncated trainer.json": lambda s, o: truncate(s / "trainer.json", 0.5),
    "truncated manifest.json": lambda s, o: truncate(s / "manifest.json", 0.5),
    # same-size bit flips
    "bit flips in shard": lambda s, o: flip_bits(s / "state" / "__0_0.distcp"),
    "bit flips in .metadata": lambda s, o: flip_bits(s / "state" / ".metadata", 0.3, 1),
    "bit flips in rng file": lambda s, o: flip_bits(s / "rng" / "rank_0.pt", 0.6),
    "bit flip in trainer.json digit": lambda s, o: (s / "trainer.json").write_text(
        (s / "trainer.json").read_text().replace('"samples_seen": 8', '"samples_seen": 9', 1)),
    # edited manifest fields
    "manifest: every optimizer entry absent": lambda s, o: edit_manifest(s, _all_optimizer_absent),
    "manifest: every optimizer entry absent, resealed": lambda s, o: reseal(s, _all_optimizer_absent),
    "manifest: step edited": lambda s, o: edit_manifest(s, lambda m: m.update(step=1)),
    "manifest: a hash edited": lambda s, o: edit_manifest(
        s, lambda m: m["hashes"]["files"].update({"trainer.json": "0" * 64})),
    "manifest: world size 2, resealed": lambda s, o: reseal(s, lambda m: m.update(world_size=2)),
    "manifest: lists a path outside": lambda s, o: reseal(
        s, lambda m: (m["files"].update({"../run.json": 97}), m["hashes"]["files"].update({"../run.json": "0"}))),
    "data position 10^9, resealed": lambda s, o: (_data_position(10**9)(s), reseal(s)),
    "data position off by one, resealed": lambda s, o: (_data_position(7)(s), reseal(s)),
    # missing files
    "missing shard": lambda s, o: (s / "state" / "__0_0.distcp").unlink(),
    "missing .metadata": lambda s, o: (s / "state" / ".metadata").unlink(),
    "missing rng file": lambda s, o: (s / "rng" / "rank_0.pt").unlink(),
    "missing rng file, resealed": lambda s, o: ((s / "rng" / "rank_0.pt").unlink(), reseal(s)),
    "missing trainer.json": lambda s, o: (s / "trainer.json").unlink(),
    "missing manifest.json": lambda s, o: (s / "manifest.json").unlink(),
    # extra files
    "extra shard": lambda s, o: (s / "state" / "__1_0.distcp").write_bytes(b"\0" * 64),
    "extra rng rank, resealed": lambda s, o: (shutil.copy2(s / "rng" / "rank_0.pt", s / "rng" / "rank_1.pt"),
                                              reseal(s)),
    "extra file in step dir": lambda s, o: (s / "notes.txt").write_text("hi"),
    # garbage that still hashes right
    "garbage rng file, resealed": _garbage_rng,
    "tensor size forged in .metadata, resealed": _forged_tensor_size,
    # symlinks and special files
    "shard is a symlink to an identical copy": _symlink_to_copy("state/__0_0.distcp"),
    "rng dir is a symlink to an identical copy": _symlink_to_copy("rng"),
    "trainer.json is a FIFO": _fifo("trainer.json"),
}


@pytest.fixture(params=sorted(CASES), ids=lambda c: c.replace(" ", "_").replace(",", "").replace(":", ""))
def damaged(request, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    CASES[request.param](run / STEP, outside)
    return request.param, run


def _assert_refused(r, run: Path, before: dict) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output[-3000:])
    assert "Traceback" not in r.output, r.output[-3000:]
    assert tree_state(run) == before


def test_resume_refuses_every_damage(damaged):
    """`rl resume` (a real resume, not a dry run) detects the damage before anything loads."""
    _case, run = damaged
    before = tree_state(run)
    r = cli("resume", str(run), "trainer.total_steps=3")
    _assert_refused(r, run, before)


def test_inspect_verify_refuses_every_damage(damaged):
    _case, run = damaged
    before = tree_state(run)
    r = cli("inspect-ckpt", str(run / STEP), "--verify")
    _assert_refused(r, run, before)


def test_export_refuses_every_damage(damaged, tmp_path):
    """`rl export` verifies the checkpoint as `rl resume` does (it used to check sizes only, and
    read `.metadata` with pickle.load): every damage is refused and no output is written."""
    _case, run = damaged
    before = tree_state(run)
    r = cli("export", str(run), "--out", str(tmp_path / "out"))
    _assert_refused(r, run, before)
    assert not (tmp_path / "out").exists()


def test_export_never_runs_code_from_the_checkpoint(trained, tmp_path):
    """A `.metadata` that pickles os.system, manifest resealed to match (so verification by
    hashes passes): `rl export` refuses it with exit 2 and the marker is never created (it
    used to be: export read `.metadata` with DCP's pickle.load). A planted optimizer value
    (export never loads it) is refused too: every pickle goes through the restricted reader."""
    from tests.ckpt_tools import RunsCode

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    marker = tmp_path / "PWNED"
    (run / STEP / "state" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    reseal(run / STEP)
    before = tree_state(run)
    r = cli("export", str(run), "--out", str(tmp_path / "out"))
    _assert_refused(r, run, before)
    assert "posix.system" in r.output.replace("\n", "") and not marker.exists()
    assert not (tmp_path / "out").exists()

    run2 = tmp_path / "run2"
    shutil.copytree(trained, run2)
    plant_code_in_shard(run2 / STEP, marker)
    before = tree_state(run2)
    r = cli("export", str(run2), "--out", str(tmp_path / "out2"))
    _assert_refused(r, run2, before)
    assert "posix.system" in r.output.replace("\n", "") and not marker.exists()
    assert not (tmp_path / "out2").exists()


def test_default_export_inside_the_step_keeps_it_resumable(trained, tmp_path):
    """`rl export RUN` writes step_N/hf; that directory is not a checkpoint file, so the step
    still verifies (resume, inspect --verify) and a second export (--overwrite) works. Before,
    verification refused the step ("hf/model.safetensors is not listed in manifest.json")."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    assert cli("export", str(run)).exit_code == 0
    assert (run / STEP / "hf" / "model.safetensors").is_file()
    r = cli("resume", str(run), "trainer.total_steps=3", "--dry-run")
    assert r.exit_code == 0, r.output[-3000:]
    assert cli("inspect-ckpt", str(run / STEP), "--verify").exit_code == 0
    r = cli("export", str(run), "--overwrite")
    assert r.exit_code == 0, r.output[-3000:]
    (run / STEP / "hf.txt").write_text("x")  # only the export directories are skipped
    r = cli("inspect-ckpt", str(run / STEP), "--verify")
    assert r.exit_code == 2 and "hf.txt is not listed" in " ".join(r.output.split())


def test_the_undamaged_checkpoint_verifies(trained):
    """The control: the same checks pass on what `rl train` wrote (so each case above fails
    because of its damage, not because verification fails on everything)."""
    r = cli("inspect-ckpt", str(trained / STEP), "--verify", "--json")
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)["verification"]
    # the DCP metadata and shard, rng/rank_0.pt, trainer.json, rows.json
    assert v["content"] and not v["legacy"] and not v["problems"] and v["files"] == 5
    r = cli("resume", str(trained), "trainer.total_steps=3", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["verification"]["content"] is True
    r = cli("inspect-ckpt", str(trained), "--verify")
    assert r.exit_code == 0 and "verified" in r.output


def test_no_verify_skips_hashes_and_says_so_in_red(trained, tmp_path):
    """--no-verify skips the content hashes (a same-size flip then goes unseen by the plan)
    and the plan says so; structure and cross-checks still run."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    flip_bits(run / STEP / "state" / "__0_0.distcp")
    r = cli("resume", str(run), "trainer.total_steps=3", "--dry-run", "--no-verify")
    assert r.exit_code == 0, r.output
    assert "NOT verified (--no-verify)" in r.output and "--no-verify: file contents were NOT checked" in r.output
    (run / STEP / "rng" / "rank_0.pt").unlink()
    r = cli("resume", str(run), "trainer.total_steps=3", "--dry-run", "--no-verify")
    assert r.exit_code == 2 and "rng/rank_0.pt is missing" in " ".join(r.output.split())


@pytest.mark.parametrize("command", ["resume", "inspect"])
def test_code_planted_in_a_shard_never_runs(trained, tmp_path, command):
    """A shard whose pickled param-group value calls os.system, with .metadata and manifest
    (sizes, hashes, digest) fixed to match: refused with exit 2, the marker never created."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    marker = tmp_path / "PWNED"
    entry = plant_code_in_shard(run / STEP, marker)
    before = tree_state(run)
    argv = ["resume", str(run), "trainer.total_steps=3"] if command == "resume" else \
        ["inspect-ckpt", str(run / STEP)]
    for extra in ([], ["--no-verify"] if command == "resume" else ["--verify"]):
        r = cli(*argv, *extra)
        assert r.exit_code == 2, r.output[-3000:]
        assert "unsafe checkpoint" in r.output and "posix.system" in r.output.replace("\n", "")
        assert not marker.exists()
        assert tree_state(run) == before
    assert entry.startswith("optim.param_groups.")


def test_the_ranks_refuse_planted_code_too(trained, tmp_path):
    """Second guard, on the rank side: DCP loading through safe_reader + SafeLoadPlanner refuses
    the planted value (DCP's own default planner runs it: the attack is real)."""
    import torch.distributed.checkpoint as dcp

    from engine.checkpoint.safe_dcp import SafeLoadPlanner, safe_reader

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    marker = tmp_path / "PWNED"
    entry = plant_code_in_shard(run / STEP, marker)
    state = {entry: 0.0}
    with pytest.raises(BaseException, match="unsafe checkpoint|not plain data"):
        dcp.load(state, storage_reader=safe_reader(run / STEP / "state"), planner=SafeLoadPlanner())
    assert not marker.exists()
    dcp.load(state, checkpoint_id=str(run / STEP / "state"))  # torch's defaults: weights_only=False
    assert marker.exists()


def test_resume_survives_a_truncated_metrics_row(trained, tmp_path):
    """A kill during a metrics append leaves half a row: resume warns, drops it, continues,
    and every row afterwards is whole JSON (one per step)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_me')
    r = rl("resume", str(run), "trainer.total_steps=3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "not JSON rows" in " ".join(r.stdout.split())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert (run / "step_3" / "manifest.json").is_file()
    assert cli("inspect-ckpt", str(run / "step_3"), "--verify").exit_code == 0


def test_reward_code_shipped_inside_a_run_is_never_imported(trained, tmp_path, monkeypatch):
    """A run directory can carry a Python file and a config naming it as the reward function, and
    `cd run && rl resume .` makes the current directory importable. rl refuses to import a reward
    module from inside the run being resumed (dry run and real), naming the file; the marker the
    module writes when imported never appears, and nothing in the run changes."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    marker = tmp_path / "ran"
    (run / "shipped_reward.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                           f"def score(prompt, response, answer):\n    return 1.0\n")
    reseal(run / STEP, lambda m: m["config"]["task"].update(reward_fn="shipped_reward:score"))
    monkeypatch.chdir(run)
    before = tree_state(run)
    for extra in (["--dry-run"], []):
        r = cli("resume", ".", "trainer.total_steps=3", *extra)
        out = " ".join(r.output.split())
        assert r.exit_code == 2 and "inside the run directory" in out and "shipped_reward.py" in out, r.output
        assert not marker.exists()
    assert tree_state(run) == before


def test_reward_code_outside_the_run_is_the_users_own(tmp_path, monkeypatch):
    """The same check lets a module the user keeps next to the run (their working directory)
    through, and finds its location without importing it."""
    from engine.config.schema import TaskConfig
    from engine.rewards.spec import import_locations, refuse_code_inside

    (tmp_path / "run").mkdir()
    marker = tmp_path / "ran"
    (tmp_path / "users_reward.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    cfg = TaskConfig(name="dataset", reward_fn="users_reward:score", correct_fn="rl:exact_match")
    refuse_code_inside(cfg, tmp_path / "run", "the run's config")  # no error
    assert import_locations("users_reward:score") == [tmp_path / "users_reward.py"] and not marker.exists()
    with pytest.raises(Exception, match="inside the run directory"):
        refuse_code_inside(cfg, tmp_path, "the run's config")


def test_the_resume_from_the_start_directory_hint_is_a_command_that_runs_with_spaces_in_paths(tmp_path, monkeypatch):
    """The refusal for a run whose reward module cannot be imported from here tells the user to
    `cd <start dir> && rl resume <run>`; with a space (or a quote) in either path the command must
    still be one the shell runs as meant: both paths are shell-quoted."""
    import json
    import shlex

    from engine.checkpoint.start_dir import resume_from_elsewhere
    from engine.config.load import load_run_config

    start = tmp_path / "my project's dir"
    root = tmp_path / "runs dir" / "run 1"
    start.mkdir()
    root.mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"cwd": str(start)}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_run_config(["task.reward_fns=[my_rewards_nowhere:score]"]).config
    _warnings, refusals = resume_from_elsewhere(root, cfg, cfg, set())
    assert len(refusals) == 1
    command = refusals[0].split("`")[1]
    assert shlex.split(command) == ["cd", str(start), "&&", "rl", "resume", str(root)]
