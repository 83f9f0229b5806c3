"""The step directory's layout has one spelling: engine/checkpoint/layout.py's StepDir.

Protects (docs/checkpoint-format.md): the paths StepDir hands out are exactly the on-disk
format (state/, rng/rank_R.pt, trainer.json, manifest.json), a real save writes its files
there, and no module in engine/ or rlcli/ builds a step-directory path from a string literal
of its own (so a rename, or a second writer, cannot drift from the readers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.checkpoint.layout import StepDir, rng_relpath

REPO = Path(__file__).resolve().parent.parent
LAYOUT = REPO / "engine" / "checkpoint" / "layout.py"
STEP_DIR_NAMES = {"state", "rng", "trainer.json", "manifest.json"}


def _literal_step_paths(tree: ast.AST) -> list[tuple[int, str]]:
    """Step-dir names used to build a path: ``x / "state"``, ``"rng" / x``, a manifest key
    ``d["trainer.json"]``, and relative rank-file names such as ``f"rng/rank_{r}.pt"``."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and side.value in STEP_DIR_NAMES:
                    hits.append((node.lineno, f"/ {side.value!r}"))
        elif isinstance(node, ast.Subscript):
            s = node.slice
            if isinstance(s, ast.Constant) and s.value in ("trainer.json", "manifest.json"):
                hits.append((node.lineno, f"[{s.value!r}]"))
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if "rng/rank_" in text:
                hits.append((node.lineno, f"f-string {text!r}"))
    return hits


def test_the_scan_catches_each_kind_of_literal_path():
    """The guard below is only as good as its detector: each spelling it must refuse."""
    src = ('d / "state"\n"rng" / x\nPath(p) / "trainer.json"\nf"{p / \'manifest.json\'}"\n'
           'digests["trainer.json"] = 1\nf"rng/rank_{r}.pt"\n')
    assert len(_literal_step_paths(ast.parse(src))) == 6
    # what is not a step-dir path: state-dict keys, group names, display labels
    ok = 'obj["rng"]\nobj.get("rng")\nt.add_row("step", "1", "trainer.json")\ngroup = "state"\n'
    assert _literal_step_paths(ast.parse(ok)) == []


def test_no_step_dir_path_is_built_from_a_literal_outside_layout():
    found = []
    for root in ("engine", "rlcli"):
        for f in sorted((REPO / root).rglob("*.py")):
            if f == LAYOUT:
                continue
            for line, what in _literal_step_paths(ast.parse(f.read_text(), filename=str(f))):
                found.append(f"{f.relative_to(REPO)}:{line}: {what}")
    assert not found, ("build step-directory paths with engine.checkpoint.layout.StepDir (state, rng, "
                       "rng_file(rank), trainer_json, manifest_path) or its constants:\n" + "\n".join(found))


def test_stepdir_paths_are_the_documented_format(tmp_path):
    s = StepDir(tmp_path / "step_40", 40)
    assert s.state == tmp_path / "step_40" / "state"
    assert s.rng == tmp_path / "step_40" / "rng"
    assert s.rng_file(3) == tmp_path / "step_40" / "rng" / "rank_3.pt"
    assert s.trainer_json == tmp_path / "step_40" / "trainer.json"
    assert s.manifest_path == tmp_path / "step_40" / "manifest.json"
    assert rng_relpath(3) == "rng/rank_3.pt"
    assert s.relative(s.rng_file(3)) == "rng/rank_3.pt" and s.relative(s.trainer_json) == "trainer.json"


@pytest.mark.parametrize("name, step", [("step_40", 40), ("step_0", 0), (".tmp-step_7", 7),
                                        ("hf", -1), ("step_x", -1), ("state", -1)])
def test_stepdir_at_takes_the_step_from_the_name(tmp_path, name, step):
    s = StepDir.at(tmp_path / name)
    assert s == StepDir(tmp_path / name, step)
    assert StepDir.at(str(tmp_path / name)).path == tmp_path / name  # a str is accepted, a Path kept


def test_rng_files_are_the_rank_files_in_rank_order(tmp_path):
    """Rank order, not name order (rank_10 after rank_2); other names in rng/ are not rank files."""
    s = StepDir(tmp_path / "step_1", 1)
    assert s.rng_files() == []  # no rng/ at all
    s.rng.mkdir(parents=True)
    for name in ("rank_10.pt", "rank_2.pt", "rank_0.pt", "rank_x.pt", "notes.txt"):
        (s.rng / name).write_bytes(b"")
    assert s.rng_files() == [s.rng_file(0), s.rng_file(2), s.rng_file(10)]


def test_a_real_save_writes_where_stepdir_points(tmp_path):
    """The writer (engine/checkpoint/save.py) and StepDir agree: every file the save lists in
    its manifest is one of StepDir's paths."""
    import torch

    from engine.checkpoint import save
    from engine.checkpoint.layout import latest_complete

    run = tmp_path / "run"
    save.prepare_tmp(run, 3)
    state = {"model": {"w": torch.arange(6.0)}, "optim": {"param_groups.w.lr": 0.1}}
    files = save.save_rank_state(run, 3, state, 0, {"torch": torch.get_rng_state()})
    save.finalize_checkpoint(run, 3, {"step": 3}, {"samples_seen": 0, "world_size": 1}, files)
    s = latest_complete(run)
    assert s == StepDir(run / "step_3", 3) and s.complete
    assert (s.state / ".metadata").is_file() and s.trainer_json.is_file() and s.manifest_path.is_file()
    assert s.rng_files() == [s.rng_file(0)]
    listed = set(s.manifest()["files"])
    assert {rng_relpath(0), s.relative(s.trainer_json)} <= listed
    assert all((s.path / rel).is_file() for rel in listed)
    assert {s.relative(p) for p in s.path.rglob("*") if p.is_file()} - {"manifest.json"} == listed


def test_a_rank_restores_its_own_gpus_generator_whatever_the_save_kept():
    """A rank saves its own GPU's CUDA generator state (a one-element list) and restores it to its
    current device, whatever index that device has; from a checkpoint that kept every visible
    GPU's state, the entry at the rank's index when it sees as many GPUs as the save did, and none
    otherwise (before, ``set_rng_state_all`` raised where it saw fewer: a run saved with every GPU
    visible, resumed under Ray's one GPU per rank; and where it saw more, rank 3 on cuda:3 would
    have taken rank 0's)."""
    from engine.checkpoint.save import own_cuda_rng_state

    own, a, b, c = (object() for _ in range(4))
    assert own_cuda_rng_state([own], 0, 1) is own
    assert own_cuda_rng_state([own], 5, 8) is own  # saved by a rank on cuda:5: its own, one entry
    assert own_cuda_rng_state([a, b, c], 1, 3) is b  # an older checkpoint, the same GPUs visible
    assert own_cuda_rng_state([a, b, c], 0, 1) is None  # saved seeing 3, resumed seeing 1: unknown
    assert own_cuda_rng_state([a, b], 3, 8) is None
