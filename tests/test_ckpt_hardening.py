"""Checkpoint hardening that needs no trained run (fast): bounded unpickling, special files,
symlink loops, hashes computed while writing, safe RNG and metadata loading, partial metrics rows.
(The corrupt-checkpoint matrix and the planted-code attack on a real run: test_ckpt_corruption.py.)
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.errors import CheckpointError


def cli(*argv):
    from rlcli.main import app

    return CliRunner().invoke(app, list(argv), env={"COLUMNS": "200", "NO_COLOR": "1"})


def torch_save_zip(path: Path, data_pkl: bytes) -> Path:
    """A file laid out as torch.save writes it, holding ``data_pkl`` as its object pickle."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/version", "3\n")
    return path


def shared_reference_bomb() -> bytes:
    """Nine levels of 10 references to the level below: 10^8+ leaves in a few hundred bytes."""
    x: list = [0]
    for _ in range(8):
        x = [x] * 10
    return pickle.dumps(x, protocol=2)


# ---- finding 4: bounded work in `rl inspect-ckpt` ------------------------------------------
def test_shared_reference_bomb_is_refused_quickly(tmp_path):
    """A sub-kilobyte .pt whose containers share references (10^8 leaves) is refused by the
    node budget, not walked (the old reader flattened every leaf and ran out of memory)."""
    data = shared_reference_bomb()
    assert len(data) < 1000
    f = torch_save_zip(tmp_path / "bomb.pt", data)
    assert f.stat().st_size < 2000
    r = cli("inspect-ckpt", str(f))
    assert r.exit_code == 2, r.output
    assert "expands to more than" in " ".join(r.output.split()) and "Traceback" not in r.output


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_self_referencing_container_is_refused_not_recursion_error(tmp_path, kind):
    x: object
    if kind == "list":
        x = []
        x.append(x)
    else:
        x = {}
        x["self"] = x
    f = torch_save_zip(tmp_path / "loop.pt", pickle.dumps({"state": x}, protocol=2))
    r = cli("inspect-ckpt", str(f), "--json")
    assert r.exit_code == 2, r.output
    assert "contains itself" in " ".join(r.output.split()) and "RecursionError" not in r.output


def test_deep_nesting_and_huge_allocations_are_refused():
    from engine.checkpoint.io.safe_unpickle import PickleTooLargeError, load_pickle

    deep = b"\x80\x02" + b"(" * 500 + b"]" + b"l" * 500 + b"."  # 500 nested lists, built iteratively
    with pytest.raises(PickleTooLargeError, match="nests containers more than"):
        load_pickle(deep, source="deep.pkl")
    # bytes(10**12) through an allowed constructor: refused before allocating
    evil = b"\x80\x02cbuiltins\nbytes\nq\x00\x8a\x06\x00\x10\xa5\xd4\xe8\x00\x85q\x01Rq\x02."
    with pytest.raises(PickleTooLargeError, match="more than"):
        load_pickle(evil, source="alloc.pkl")
    # the node budget scales with input: an honest, large but flat structure passes
    flat = pickle.dumps({f"k{i}": [i, float(i), str(i)] for i in range(100_000)}, protocol=2)
    assert len(load_pickle(flat, source="flat.pkl")) == 100_000


# ---- special files: /dev/zero, FIFOs, symlink loops ----------------------------------------
def test_devices_and_fifos_are_refused_without_reading(tmp_path):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    for target in ("/dev/zero", str(fifo)):  # a read would never end (or block): refused unopened
        r = cli("inspect-ckpt", target)
        assert r.exit_code == 2 and "not a checkpoint file" in " ".join(r.output.split()), r.output
    r = cli("resume", "/dev/zero")
    assert r.exit_code == 2


def test_symlink_loop_named_like_a_step_neither_crashes_nor_blocks_the_save(tmp_path):
    """A symlink loop named step_13 (or .tmp-step_13) is not a checkpoint: listing skips it,
    and a save of step 13 moves it aside and writes a complete step_13."""
    from engine.checkpoint.layout import latest_complete, list_steps
    from engine.checkpoint.save import finalize_checkpoint, prepare_tmp

    run = tmp_path / "run"
    run.mkdir()
    (run / "step_13").symlink_to("step_13")
    (run / ".tmp-step_13").symlink_to(".tmp-step_13")
    assert list_steps(run) == [] and latest_complete(run) is None
    r = cli("inspect-ckpt", str(run))
    assert "Traceback" not in r.output
    d = prepare_tmp(run, 13)
    assert d.is_dir() and not d.is_symlink()
    (d / "rng" / "rank_0.pt").write_bytes(b"x")
    final = finalize_checkpoint(run, 13, {"step": 13}, {"samples_seen": 0})
    assert final == run / "step_13" and final.is_dir() and not final.is_symlink()
    assert [s.step for s in list_steps(run)] == [13] and latest_complete(run).step == 13
    assert any(p.name.startswith(".stale-step_13-") and p.is_symlink() for p in run.iterdir())


# ---- hashes are computed while writing -----------------------------------------------------
def test_save_reports_hashes_of_what_it_wrote_and_finalize_records_them(tmp_path, monkeypatch):
    """save_rank_state returns a hash for every file it wrote (DCP shards, .metadata, RNG)
    without reading them back; finalize records them, covers the manifest with its own
    digest, and the step verifies."""
    import torch

    from engine.checkpoint import digest, save
    from engine.checkpoint.digest import hash_file
    from engine.checkpoint.verify import verify_step

    run = tmp_path / "run"
    save.prepare_tmp(run, 1)
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "optim": {"param_groups.w.lr": 0.1}}
    files = save.save_rank_state(run, 1, state, 0, {"torch": torch.get_rng_state()})
    assert set(files) == {"state/.metadata", "state/__0_0.distcp", "rng/rank_0.pt"}
    for rel, (n, h, algorithm) in files.items():
        assert algorithm == digest.default_algorithm()
        assert (n, h) == hash_file(run / ".tmp-step_1" / rel, algorithm), rel

    def no_rereading(path):  # finalize must use the reported hashes, not re-read the files
        raise AssertionError(f"re-read {path}")

    monkeypatch.setattr(save, "hash_file", no_rereading)
    trainer = {"step": 1, "samples_seen": 4, "data": {"epoch": 0, "index": 4, "samples_seen": 4, "n": 8}}
    final = save.finalize_checkpoint(run, 1, trainer, {"samples_seen": 4, "world_size": 1, "engine": "fsdp",
                                                       "optimizer": {"param_state": {"w": True}},
                                                       "config": {"data": {"train_batch_size": 4}}}, files)
    m = json.loads((final / "manifest.json").read_text())
    assert m["version"] == 2 and set(m["hashes"]["files"]) == set(m["files"]) == set(files) | {"trainer.json"}
    assert m["manifest_digest"] == digest.manifest_digest(m)
    v = verify_step(final, m)
    assert v.content and v.problems == [], v.problems


def test_legacy_manifest_without_hashes_is_accepted_with_sizes_only(tmp_path):
    """Policy (docs/security.md): a version-1 manifest (written before hashes) is checked for
    structure, sizes and cross-checks, and reported as 'sizes only' instead of refused."""
    from engine.checkpoint.verify import verify_step

    step = tmp_path / "step_1"
    (step / "state").mkdir(parents=True)
    (step / "trainer.json").write_text("{}")
    m = {"format": "rl-checkpoint", "version": 1, "step": 1, "files": {"trainer.json": 2}}
    v = verify_step(step, m, content=True)
    assert v.legacy and not v.content and "sizes only" in v.summary
    m["version"] = 2  # the same manifest claiming version 2 must carry hashes and a digest
    v = verify_step(step, m, content=True)
    assert any("no 'manifest_digest'" in p for p in v.problems)


# ---- safe loading on the rank side ---------------------------------------------------------
def test_garbage_rng_file_is_a_checkpoint_error(tmp_path):
    from engine.checkpoint.restore import load_rng_file

    f = tmp_path / "rank_0.pt"
    f.write_bytes(os.urandom(2048))
    with pytest.raises(CheckpointError, match="not a readable RNG state"):
        load_rng_file(f)
    import torch

    torch.save({"torch": torch.get_rng_state(), "evil": __import__("collections").Counter()}, f)
    with pytest.raises(CheckpointError):
        load_rng_file(f)


def test_dcp_metadata_that_would_run_code_is_refused_by_the_rank_reader(tmp_path):
    from engine.checkpoint.safe_dcp import safe_reader
    from tests.ckpt_tools import RunsCode

    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(tmp_path / "PWNED")))
    with pytest.raises(CheckpointError, match="posix.system"):
        safe_reader(tmp_path).read_metadata()
    assert not (tmp_path / "PWNED").exists()


def test_truncated_metrics_row_is_dropped_and_the_file_ends_in_a_newline(tmp_path):
    from engine.checkpoint.run_files import truncate_jsonl

    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"step": 3, "rew')
    assert truncate_jsonl(p, 2) == 1
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    p.write_text(json.dumps({"step": 1}))  # whole row, no newline: the next append must not glue to it
    truncate_jsonl(p, 5)
    assert p.read_text().endswith("\n")


def test_hash_algorithm_follows_whether_xxhash_imports(tmp_path, monkeypatch):
    """XXH3 when xxhash imports (a core dependency), BLAKE2b otherwise; a checkpoint hashed
    with XXH3 on a machine without xxhash is a clear error naming the package, not a traceback."""
    import sys

    from engine.checkpoint import digest

    f = tmp_path / "f"
    f.write_bytes(b"abc" * 1000)
    assert digest.hash_file(f, digest.BLAKE2B)[1] == digest.hash_bytes(b"abc" * 1000)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # as if the package were not installed
    assert digest.default_algorithm() == digest.BLAKE2B
    with pytest.raises(CheckpointError, match=r"pip install xxhash"):
        digest.hash_file(f, digest.XXH3)


# ---- JSON nested past the parser's recursion limit ------------------------------------------
def test_deeply_nested_json_in_run_files_is_malformed_not_a_recursion_error(tmp_path):
    """A metrics.jsonl row nested 200k levels deep (a few hundred KB) used to raise
    RecursionError out of `rl plot` (traceback, exit 1): every engine reader of run/model
    directory JSON goes through engine.json_safe.loads, which turns it into the ValueError
    those readers already handle (the row is skipped like a half-written one)."""
    import ast

    from engine import json_safe
    from engine.tracking.series import run_metrics

    deep = "[" * 200_000 + "]" * 200_000
    with pytest.raises(ValueError, match="nested too deeply"):
        json_safe.loads(deep)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/reward": 0.5}) + "\n" +
                                       '{"step": 2, "x": ' + deep + "}\n")
    assert set(run_metrics(run)) == {1}
    repo = Path(__file__).resolve().parents[1]
    raw = [f"{f.relative_to(repo)}:{n.lineno}" for f in sorted((repo / "engine").rglob("*.py"))
           if f.name != "json_safe.py" for n in ast.walk(ast.parse(f.read_text()))
           if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("loads", "load")
           and getattr(n.func.value, "id", "") == "json"]
    assert not raw, f"use engine.json_safe.loads: {raw}"


# ---- YAML alias bombs in a run directory's config.yaml ---------------------------------------
def yaml_bomb() -> str:
    """Ten lines whose aliases expand to 9^10 (3.5 billion) nodes."""
    return "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(9))


def test_yaml_alias_bomb_in_config_yaml_is_refused_in_bounded_time(tmp_path):
    """A config.yaml holding a YAML bomb made a real `rl resume` hang for ever (RunDir read it
    with OmegaConf, which expands every alias). engine.yaml_safe counts nodes as they expand
    and refuses past 1M; every reader of a run directory's YAML (resume's env references,
    inspect-ckpt, mem-report) goes through it. A normal config still loads."""
    import time

    from engine import yaml_safe
    from engine.checkpoint.io.files import read_yaml
    from engine.trainer.run_dir import RunDir

    (tmp_path / "config.yaml").write_text(yaml_bomb())
    t0 = time.perf_counter()
    with pytest.raises(yaml_safe.YamlTooLarge, match="YAML bomb"):
        yaml_safe.check_bounded(yaml_bomb(), "config.yaml")
    assert read_yaml(tmp_path / "config.yaml") is None
    rd = RunDir(tmp_path)
    rd.load_env_refs([])
    assert rd.env_refs == {}
    assert time.perf_counter() - t0 < 20  # each refusal stops after 1M nodes (~1 s)
    with pytest.raises(yaml_safe.YamlTooLarge, match="nest"):
        yaml_safe.check_bounded("a: " + "[" * 5000 + "]" * 5000)
    (tmp_path / "config.yaml").write_text("model:\n  path: ${oc.env:MODEL_DIR}\ntrainer: {seed: 1}\n")
    assert read_yaml(tmp_path / "config.yaml") == {"model": {"path": "${oc.env:MODEL_DIR}"}, "trainer": {"seed": 1}}
    rd.load_env_refs([])
    assert "model.path" in rd.env_refs
