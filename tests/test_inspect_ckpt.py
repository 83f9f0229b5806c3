"""`rl inspect-ckpt`: every format read from metadata only, hostile and damaged inputs
refused with a clear error, --keys / --diff / --json through the real CLI.

Checkpoints are written by the real writers (tests/inspect_fixtures.py)."""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engine.errors import CheckpointError
from engine.inspect import diff_paths, inspect_path
from engine.inspect.config_check import check_config
from engine.inspect.report import CheckpointReport, RunReport
from engine.checkpoint.io.safe_unpickle import UnsafePickleError
from tests import inspect_fixtures as fx

# ----------------------------------------------------------------------------------------
# CLI helper


def run_cli(*args: str):
    """Invoke `rl inspect-ckpt ARGS` on rlcli.main.app (wide terminal, stderr separate)."""
    from rlcli.main import app

    # Typer runs a lone command as the app itself; with siblings it is a subcommand.
    names = {c.name for c in app.registered_commands}
    argv = ["inspect-ckpt", *args] if len(names) > 1 or app.registered_callback else list(args)
    return CliRunner().invoke(app, argv, env={"COLUMNS": "220", "NO_COLOR": "1"})


def assert_clean_exit_2(res, *needles: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    text = res.output + (res.stderr or "")
    assert "Traceback" not in text
    for n in needles:
        assert n.lower() in text.lower(), (n, text)


# ----------------------------------------------------------------------------------------
# rl run root (shared by several tests)


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory) -> Path:
    root = fx.make_rl_run(tmp_path_factory.mktemp("rl") / "ckpt")
    params = fx.tiny_params()
    fx.make_rl_step(root, 10, params)
    p20 = dict(params, **{"unused.weight": torch.zeros(4, 8), "broken.weight": torch.zeros(3),
                          "rotary.inv_freq": torch.zeros(4)})
    fx.make_rl_step(root, 20, p20,
                    with_state=set(params) - {"lm_head.weight"} | {"lm_head.weight"},
                    legit_missing=frozenset({"unused.weight"}),
                    orphans=("gone.weight",), frozen=("rotary.inv_freq",))
    # broken.weight: trainable, manifest says it has state, but none was saved
    man = json.loads((root / "step_20" / "manifest.json").read_text())
    man["optimizer"]["param_state"]["broken.weight"] = True
    (root / "step_20" / "manifest.json").write_text(json.dumps(man))
    fx.make_rl_step(root, 30, params, manifest=False)
    (root / ".tmp-step_40" / "state").mkdir(parents=True)
    return root


def test_rl_run_root_lists_every_step_and_latest(rl_run):
    """The run view lists complete, manifest-less and in-progress steps with sizes, and
    picks as latest the highest step holding a manifest (what rl resume picks)."""
    run = inspect_path(rl_run)
    assert isinstance(run, RunReport) and run.format == "rl-run"
    by = {s.name: s for s in run.steps}
    assert set(by) == {"step_10", "step_20", "step_30", ".tmp-step_40"}
    assert by["step_10"].complete and by["step_20"].complete
    assert not by["step_30"].complete and "manifest" in by["step_30"].reason
    assert not by[".tmp-step_40"].complete
    assert run.latest == "step_20" and by["step_20"].latest and not by["step_10"].latest
    assert all(s.bytes > 0 for s in run.steps if s.name != ".tmp-step_40")
    assert by["step_20"].samples_seen == 320
    assert run.versions["python"] == "3.11.7"


def test_rl_step_summary_groups_and_coverage(rl_run):
    """One rl step: step, world size, layout, groups (model / optimizer state / param groups /
    rng / scheduler / data) and optimizer coverage: full, legitimately missing (what resume
    backfills), unexpectedly missing, orphans; frozen params are not counted."""
    rep = inspect_path(rl_run / "step_20")
    assert isinstance(rep, CheckpointReport) and rep.format == "rl" and rep.complete
    assert rep.step == 20 and rep.world_size == 1 and rep.layout["dp"] == 1
    assert rep.info["samples_seen"] == 320
    groups = {g.group: g for g in rep.groups()}
    assert groups["model"].tensors == 9
    assert groups["model"].dtypes == {"float32": 7, "bfloat16": 2}
    assert groups["optimizer state"].tensors == 3 * 7  # 6 params with state + 1 orphan
    assert groups["optimizer param groups"].objects == 3 * 9  # 8 trainable + 1 orphan
    assert groups["rng"].tensors >= 2  # torch ByteTensor + numpy MT19937 key
    assert groups["scheduler"].objects == 3 and groups["data"].objects == 4
    model_bytes = sum(t.numel() * t.element_size() for t in fx.tiny_params().values())
    assert groups["model"].bytes == model_bytes + (32 + 3 + 4) * 4
    cov = rep.optimizer
    assert cov.state_names == ["exp_avg", "exp_avg_sq", "step"] and cov.manifest
    assert cov.params == 8  # rotary.inv_freq is frozen (not in param_state)
    assert cov.none_expected == ["unused.weight"]
    assert cov.none_unexpected == ["broken.weight"]
    assert len(cov.full) == 6
    assert cov.orphan_params == ["gone.weight"]
    assert len(cov.orphans) == 6  # 3 state entries + 3 param-group entries
    assert rep.total_bytes == sum(f.bytes for f in rep.files)
    assert "manifest.json" in {f.path for f in rep.files}
    assert rep.config["trainer"]["total_steps"] == 40
    assert rep.versions["python"] == "3.11.7"


def test_rl_step_without_manifest_is_reported_incomplete(rl_run):
    """A step_N without manifest.json is shown (not an error) as incomplete, with why."""
    rep = inspect_path(rl_run / "step_30")
    assert not rep.complete
    assert any("manifest" in r for r in rep.incomplete_reasons)
    assert {g.group for g in rep.groups()} >= {"model", "optimizer state"}


def test_rl_step_not_matching_manifest_is_corrupt(tmp_path):
    """A step whose state file is shorter than its manifest says fails with a clear error
    naming the file; the CLI exits 2 without a traceback."""
    root = fx.make_rl_run(tmp_path / "ckpt")
    d = fx.make_rl_step(root, 5, fx.tiny_params())
    fx.truncate(d / "state" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="__0_0.distcp"):
        inspect_path(d)
    assert_clean_exit_2(run_cli(str(d)), "__0_0.distcp", "manifest")
    run = inspect_path(root)  # the run view still lists it, flagged
    assert run.steps[0].reason.startswith("corrupt")


def test_config_check_reports_removed_and_renamed_keys():
    """Saved config keys present in the removed-key registry are reported with their
    replacement and reason; other keys are not."""

    class Entry:
        def __init__(self, key, replacement, reason):
            self.key, self.replacement, self.reason = key, replacement, reason

    registry = {"trainer.old_steps": Entry("trainer.old_steps", "trainer.total_steps", "renamed"),
                "algo": Entry("algo", "algorithm", "section renamed")}
    saved = {"trainer": {"old_steps": 7, "seed": 1}, "algo": {"kl": 0.1}, "data": {"x": 1}}
    issues, status = check_config(saved, registry)
    by = {i.key: i for i in issues}
    assert set(by) == {"trainer.old_steps", "algo"}
    assert by["trainer.old_steps"].replacement == "trainer.total_steps"
    assert by["trainer.old_steps"].saved_value == 7
    assert by["algo"].saved_value == {"algo.kl": 0.1}
    assert "2 found" in status


def test_config_check_uses_the_real_registry(tmp_path):
    """A checkpoint whose saved config holds a key from engine/config/removed_keys.py shows
    it, with its replacement, in the report and the table."""
    from engine.config.removed_keys import REMOVED_KEYS

    entry = next(iter(REMOVED_KEYS.values()))
    cfg: dict = {"trainer": {"total_steps": 4}}
    node = cfg
    parts = entry.key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = True
    d = fx.make_rl_step(fx.make_rl_run(tmp_path / "ckpt"), 4, fx.tiny_params(), config=cfg)
    rep = inspect_path(d)
    assert [(i.key, i.replacement) for i in rep.config_issues] == [(entry.key, entry.replacement)]
    out = run_cli(str(d)).output
    assert entry.key in out and (entry.replacement or "(removed)") in out


# ----------------------------------------------------------------------------------------
# plain DCP, torch.save, safetensors


def test_plain_dcp_dir(tmp_path):
    """A plain DCP directory: tensors with dtype/shape, non-tensor entries, files and sizes,
    world size from the data files."""
    d = fx.save_dcp(tmp_path / "dcp", {
        "model": {"w": torch.randn(6, 4), "b": torch.zeros(4, dtype=torch.float16)},
        "meta": {"note": "hi", "n": 3}, "step": torch.tensor(7)})
    rep = inspect_path(d)
    assert rep.format == "dcp" and rep.world_size == 1
    t = {x.name: x for x in rep.tensors}
    assert t["model.w"].shape == (6, 4) and t["model.w"].dtype == "float32"
    assert t["model.b"].dtype == "float16" and t["model.b"].nbytes == 8
    assert t["step"].shape == () and t["step"].dtype == "int64"
    assert {o.name for o in rep.objects} == {"meta.note", "meta.n"}
    assert all(o.stored_bytes for o in rep.objects)
    assert {f.path for f in rep.files} == {".metadata", "__0_0.distcp"}
    assert rep.total_bytes == sum(p.stat().st_size for p in d.iterdir())


def test_torch_save_file_reads_structure_not_storage_bytes(tmp_path):
    """A torch.save file: nested names, dtypes, shapes (views, Parameters, bf16, numpy RNG),
    scalars as entries; tensor data is never read: corrupting a storage's bytes (its
    zip CRC then fails) does not matter."""
    p = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.full((256,), 7.0), "v": torch.randn(10)[2:5],
                          "p": torch.nn.Parameter(torch.ones(2, 2)),
                          "h": torch.zeros(3, dtype=torch.bfloat16)},
                "optimizer": {"state": {0: {"exp_avg": torch.zeros(256)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]},
                "rng": fx.rng_state(), "global_step": 12}, p)
    raw = bytearray(p.read_bytes())
    pattern = torch.full((256,), 7.0).numpy().tobytes()
    at = bytes(raw).find(pattern)
    assert at > 0
    raw[at:at + len(pattern)] = b"\x00" * len(pattern)
    p.write_bytes(bytes(raw))
    with zipfile.ZipFile(p) as z:
        storage = next(n for n in z.namelist() if "/data/" in n and z.getinfo(n).file_size == 1024)
        with pytest.raises(zipfile.BadZipFile):
            z.read(storage)  # the data really is damaged...
    rep = inspect_path(p)  # ...and inspecting never touched it
    t = {x.name: x for x in rep.tensors}
    assert rep.format == "torch-save" and rep.step == 12
    assert t["model.w"].shape == (256,) and t["model.v"].shape == (3,)
    assert t["model.p"].shape == (2, 2) and t["model.h"].dtype == "bfloat16"
    assert t["optimizer.state.0.exp_avg"].group == "optimizer state"
    assert t["rng.torch"].dtype == "uint8" and t["rng.numpy.1"].dtype == "uint32"
    o = {x.name: x for x in rep.objects}
    assert o["optimizer.param_groups.0.lr"].group == "optimizer param groups"
    assert o["global_step"].preview == "12"


def test_safetensors_single_and_sharded(tmp_path):
    """safetensors: a single file and a sharded directory (index + shards) give every
    tensor with dtype and shape; the HF config and transformers version are picked up."""
    from safetensors.torch import save_file

    state = {f"model.layers.{i}.w": torch.randn(64, 64) for i in range(4)}
    state["lm_head.weight"] = torch.randn(32, 64).to(torch.bfloat16)
    save_file(state, str(tmp_path / "one.safetensors"))
    one = inspect_path(tmp_path / "one.safetensors")
    assert one.format == "safetensors" and len(one.tensors) == 5

    d = fx.save_hf_sharded(tmp_path / "hf", state, max_shard_size=20_000)
    assert (d / "model.safetensors.index.json").exists()
    rep = inspect_path(d)
    assert rep.format == "safetensors" and "shard" in rep.format_detail
    t = {x.name: x for x in rep.tensors}
    assert len(t) == 5 and t["lm_head.weight"].dtype == "bfloat16"
    assert t["model.layers.0.w"].shape == (64, 64)
    assert rep.groups()[0].bytes == sum(v.numel() * v.element_size() for v in state.values())
    assert rep.versions["transformers"] == "4.57.0"

    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        inspect_path(d)


@pytest.mark.parametrize("entry,needle", [
    ({"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}, "has shape 'x'"),
    ({"dtype": "F32", "shape": [None], "data_offsets": [0, 4]}, "has shape [None]"),
    ({"dtype": "F32", "shape": [-1, 1], "data_offsets": [0, 4]}, "has shape [-1, 1]"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "has data_offsets [4, 0]"),
    ({"dtype": "F32", "shape": [10 ** 19], "data_offsets": [0, 4]}, "holds 4 bytes for a F32 tensor"),
    ({"dtype": 7, "shape": [1], "data_offsets": [0, 4]}, "has dtype 7"),
    ("nothing", "is not a JSON object"),
])
def test_a_safetensors_header_entry_that_cannot_be_a_tensor_is_a_corrupt_file(tmp_path, entry, needle):
    """A shape of 'x' raised int('x') in `rl inspect-ckpt` (a traceback, exit 1); a negative shape
    was reported as -16 bytes, a 10**19-element tensor over 4 bytes of data as fine."""
    import json
    import struct

    h = json.dumps({"w": entry}).encode()
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 4)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        inspect_path(f)
    h = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 4)
    assert [(x.name, x.shape) for x in inspect_path(f).tensors] == [("w", (2,))]


# ----------------------------------------------------------------------------------------
# verl FSDP and megatron-core (need a process group of one)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    import torch.distributed as dist

    created = fx.init_single_process_group(tmp_path_factory.mktemp("pg"))
    yield
    if created:
        dist.destroy_process_group()


def test_verl_fsdp_layout(tmp_path, process_group):
    """verl's layout: the save dir (pointer file + global_step_N) and a step dir whose
    per-rank FSDP2 files give global DTensor shapes, optimizer state, scheduler, rng."""
    step_dir = fx.save_verl_fsdp(tmp_path / "verl", 100)
    run = inspect_path(tmp_path / "verl")
    assert run.format == "verl-run" and run.latest == "global_step_100"
    assert run.steps[0].complete

    rep = inspect_path(step_dir)
    assert rep.format == "verl-fsdp" and rep.step == 100 and rep.world_size == 1
    t = {x.name: x for x in rep.tensors}
    assert t["model.0.weight"].shape == (16, 8) and "Shard(0)" in t["model.0.weight"].placement
    groups = {g.group: g for g in rep.groups()}
    assert groups["model"].tensors == 4
    assert groups["optimizer state"].tensors == 4 * 3  # exp_avg, exp_avg_sq, step per param
    assert groups["scheduler"].objects > 0 and groups["rng"].tensors >= 2
    assert rep.info["actor_fsdp_config"]["FSDP_version"] == 2

    (step_dir / "actor" / "optim_world_size_1_rank_0.pt").unlink()
    rep = inspect_path(step_dir)
    assert not rep.complete and any("optim" in r for r in rep.incomplete_reasons)


@pytest.mark.megatron
def test_megatron_dist_checkpoint(tmp_path, process_group):
    """megatron-core dist_checkpointing (torch_dist): sharded tensors from the DCP metadata,
    iteration and parallel layout from common.pt's args, Megatron optimizer coverage."""
    pytest.importorskip("megatron.core")
    d = fx.save_megatron_dist(tmp_path / "iter_0000030")
    rep = inspect_path(d)
    assert rep.format == "megatron" and rep.step == 30
    assert rep.layout["tp"] == 1 and rep.layout["pp"] == 1 and rep.world_size == 1
    t = {x.name: x for x in rep.tensors}
    assert t["embedding.word_embeddings.weight"].dtype == "bfloat16"
    assert t["decoder.layers.0.mlp.linear_fc1.weight"].group == "model"
    assert t["optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"].group == "optimizer state"
    assert rep.optimizer.full == ["decoder.layers.0.mlp.linear_fc1.weight"]
    assert rep.config["hidden_size"] == 16
    assert any(o.group == "rng" for o in rep.objects)


# ----------------------------------------------------------------------------------------
# hostile input


def _malicious_dcp(tmp_path: Path, marker: Path) -> Path:
    d = fx.save_dcp(tmp_path / "evil_dcp", {"w": torch.zeros(2)})
    (d / ".metadata").write_bytes(pickle.dumps(fx.RunsShellCommand(f"touch {marker}"), protocol=2))
    return d


def test_malicious_pickles_never_run(tmp_path):
    """A pickle whose __reduce__ calls os.system (as DCP .metadata, and inside a torch.save
    file written by torch.save itself) is refused: the command does not run, the error
    names the refused global, the CLI exits 2."""
    marker = tmp_path / "pwned"
    evil_pt = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "x": fx.RunsShellCommand(f"touch {marker}")}, evil_pt)
    evil_dcp = _malicious_dcp(tmp_path, marker)
    for target in (evil_pt, evil_dcp):
        with pytest.raises(UnsafePickleError, match="system"):
            inspect_path(target)
        assert_clean_exit_2(run_cli(str(target)), "refused")
        assert not marker.exists()
    # a builtins.eval/getattr gadget is refused the same way
    gadget = b"\x80\x02cbuiltins\neval\nq\x00X\x0e\x00\x00\x00print('oops')\x85R."
    (evil_dcp / ".metadata").write_bytes(gadget)
    with pytest.raises(UnsafePickleError, match="builtins.eval"):
        inspect_path(evil_dcp)
    assert not marker.exists()
    # control: the payload is live, plain pickle does run it
    pickle.loads(pickle.dumps(fx.RunsShellCommand(f"touch {marker}"), protocol=2))
    assert marker.exists()


# ----------------------------------------------------------------------------------------
# damaged input


@pytest.mark.parametrize("damage", ["truncate_metadata", "garbage_metadata", "no_metadata",
                                    "truncate_data"])
def test_damaged_dcp_is_a_clear_error(tmp_path, damage):
    """Truncated, corrupt or missing DCP metadata, or a truncated data file: a
    CheckpointError that says what is wrong; the CLI exits 2 with no traceback."""
    d = fx.save_dcp(tmp_path / "dcp", {"w": torch.randn(64, 64), "b": torch.randn(64)})
    if damage == "truncate_metadata":
        fx.truncate(d / ".metadata")
        needle = "truncated or corrupt"
    elif damage == "garbage_metadata":
        (d / ".metadata").write_bytes(np.random.default_rng(0).bytes(300))
        needle = "corrupt"
    elif damage == "no_metadata":
        (d / ".metadata").unlink()
        needle = "no .metadata"
    else:
        fx.truncate(d / "__0_0.distcp")
        needle = "truncated"
    with pytest.raises(CheckpointError, match=needle.split()[0]):
        inspect_path(d)
    assert_clean_exit_2(run_cli(str(d)), needle)


def test_damaged_single_files_are_clear_errors(tmp_path):
    """A truncated torch.save archive or safetensors file is a clear error (exit 2)."""
    from safetensors.torch import save_file

    pt = tmp_path / "m.pt"
    torch.save({"w": torch.randn(128, 128)}, pt)
    fx.truncate(pt)
    st = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(128, 128)}, str(st))
    fx.truncate(st)
    for p in (pt, st):
        with pytest.raises(CheckpointError, match="truncated"):
            inspect_path(p)
        assert_clean_exit_2(run_cli(str(p)), "truncated")


def test_unknown_layout_lists_what_was_found(tmp_path):
    """A directory in no known layout: the error lists its entries and the known layouts."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    assert_clean_exit_2(run_cli(str(tmp_path)), "weights/", "notes.txt", "known layouts")
    assert_clean_exit_2(run_cli(str(tmp_path / "nope")), "does not exist")


def test_paths_the_os_refuses_are_clear_errors(tmp_path):
    """A symlink loop (was: "does not exist"), a name too long for the file system and a file the
    OS will not open (/proc/1/mem: both were tracebacks), as PATH or as --diff OTHER: exit 2, one
    paragraph naming the problem; a newline in a name is shown escaped, not breaking the paragraph."""
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    assert_clean_exit_2(run_cli(str(tmp_path / "loop_a")), "loops through symbolic links")
    assert_clean_exit_2(run_cli(str(tmp_path), "--diff", str(tmp_path / "loop_a")), "loops through symbolic links")
    assert_clean_exit_2(run_cli(str(tmp_path / ("a" * 5000))), "too long")
    res = run_cli(str(tmp_path / "two\nlines"))
    assert_clean_exit_2(res, "does not exist", "two\\nlines")
    try:
        open("/proc/1/mem", "rb").close()
        readable = True
    except OSError:
        readable = False
    if not readable:
        assert_clean_exit_2(run_cli("/proc/1/mem"), "/proc/1/mem", "permission denied")


def test_an_unforeseen_os_error_is_a_clean_exit_not_a_traceback(monkeypatch, tmp_path):
    """The last net in rlcli.output.call_engine: an OSError no check foresaw (a file removed or
    made unreadable mid-read) is one paragraph with the path and the reason, exit 2."""
    import engine.inspect as inspect_mod

    def boom(path, verify=False):
        raise PermissionError(13, "Permission denied", str(tmp_path / "state" / ".metadata"))

    monkeypatch.setattr(inspect_mod, "inspect_path", boom)
    assert_clean_exit_2(run_cli(str(tmp_path)), "state/.metadata", "permission denied")



def test_an_os_error_without_a_path_is_not_called_a_file_error(monkeypatch, tmp_path):
    """The net catches path errors only: a ConnectionResetError or TimeoutError (OSErrors with no
    file name: a dead rank, a socket) is not dressed up as "a file the command needed"; it stays
    the exception it is, for the bug report."""
    import engine.inspect as inspect_mod

    def boom(path, verify=False):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(inspect_mod, "inspect_path", boom)
    r = run_cli(str(tmp_path))
    assert isinstance(r.exception, ConnectionResetError) and "file error" not in r.output

# ----------------------------------------------------------------------------------------
# --keys, --diff, --json


def test_cli_table_and_json_carry_the_same_facts(rl_run):
    """The default table and --json show the same facts: per-group tensor counts and bytes,
    coverage counts, the step and completeness."""
    table = run_cli(str(rl_run / "step_20"))
    assert table.exit_code == 0, table.output
    res = run_cli(str(rl_run / "step_20"), "--json")
    assert res.exit_code == 0
    data = json.loads(res.stdout)
    assert data["kind"] == "checkpoint" and data["step"] == 20 and data["complete"] is True
    from engine.checkpoint.io.files import human_bytes

    for g in data["groups"]:
        row = next(line for line in table.output.splitlines() if f" {g['group']} " in line)
        assert f" {g['tensors']:,} " in row and human_bytes(g["bytes"]) in row
    assert "unused.weight" in table.output and "broken.weight" in table.output
    assert data["optimizer"]["none_expected"] == ["unused.weight"]
    assert data["optimizer"]["full"] == 6
    assert data["total_bytes"] == sum(f["bytes"] for f in data["files"])
    run = json.loads(run_cli(str(rl_run), "--json").stdout)
    assert run["kind"] == "run" and run["latest"] == "step_20"
    assert [s["name"] for s in run["steps"]][:3] == ["step_10", "step_20", "step_30"]


def test_cli_keys_lists_matching_tensors(rl_run):
    """--keys GLOB adds per-tensor rows for matching names (table and JSON); a glob that
    matches nothing is an error that shows what names look like."""
    res = run_cli(str(rl_run / "step_10"), "--keys", "model.layers.0.*", "--json")
    rows = json.loads(res.stdout)["tensors"]
    assert sorted(r["name"] for r in rows) == ["model.layers.0.mlp.weight", "model.layers.0.norm.weight"]
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    table = run_cli(str(rl_run / "step_10"), "--keys", "model.layers.0.*")
    assert "model.layers.0.mlp.weight" in table.output and "[8, 8]" in table.output
    assert_clean_exit_2(run_cli(str(rl_run / "step_10"), "--keys", "nothing.*"), "no tensor name matches")


def test_cli_diff_reports_keys_shapes_dtypes(tmp_path):
    """--diff: tensors added, removed, reshaped and re-typed, and config changes; --json of
    the diff is valid and carries the same lists."""
    root = fx.make_rl_run(tmp_path / "ckpt")
    a = fx.tiny_params()
    b = dict(a)
    b["embed_tokens.weight"] = torch.randn(20, 8)  # reshaped
    b["lm_head.weight"] = a["lm_head.weight"].to(torch.bfloat16)  # re-typed
    del b["layers.1.mlp.weight"]  # removed
    b["layers.2.mlp.weight"] = torch.randn(8, 8)  # added
    fx.make_rl_step(root, 40, a)
    fx.make_rl_step(root, 80, b, config={"trainer": {"total_steps": 80, "seed": 0},
                                         "model": {"preset": "tiny"}})
    d = diff_paths(root / "step_40", root / "step_80")
    assert [t.name for t in d.added if t.group == "model"] == ["model.layers.2.mlp.weight"]
    assert [t.name for t in d.removed if t.group == "model"] == ["model.layers.1.mlp.weight"]
    assert [(c.name, c.before, c.after) for c in d.shape_changed if c.name.startswith("model.")] \
        == [("model.embed_tokens.weight", "[16, 8]", "[20, 8]")]
    assert ("model.lm_head.weight", "float32", "bfloat16") in [
        (c.name, c.before, c.after) for c in d.dtype_changed]
    assert [c.name for c in d.config_changed] == ["trainer.total_steps"]
    res = run_cli(str(root / "step_40"), "--diff", str(root / "step_80"), "--json")
    assert res.exit_code == 0
    data = json.loads(res.stdout)
    assert data["kind"] == "diff" and not data["identical_layout"]
    assert "model.layers.2.mlp.weight" in [t["name"] for t in data["added"]]
    table = run_cli(str(root / "step_40"), "--diff", str(root / "step_80"), "--keys", "model.*")
    assert table.exit_code == 0
    assert "model.embed_tokens.weight" in table.output and "optim.state" not in table.output
    same = diff_paths(root / "step_40", root / "step_40")
    assert same.identical_layout and same.unchanged == len(inspect_path(root / "step_40").tensors)


def test_cli_help_has_runnable_examples():
    """`rl inspect-ckpt --help` ends with examples that use the real flags."""
    res = run_cli("--help")
    assert res.exit_code == 0
    for flag in ("--keys", "--diff", "--json", "rl inspect-ckpt ckpt/step_40"):
        assert flag in res.output


# ----------------------------------------------------------------------------------------
# the real writer


@pytest.mark.slow
def test_reads_what_rl_train_writes(tmp_path):
    """End to end: checkpoints written by `rl train` itself (engine/checkpoint) are read as
    complete rl checkpoints whose files match their manifest, with every trainable
    parameter carrying full AdamW state and no orphans."""
    import os
    from tests.cli_utils import rl

    ckpt = tmp_path / "ckpt"
    proc = rl("train", "trainer.total_steps=2", "checkpoint.save_freq=1", f"checkpoint.dir={ckpt}",
              "data.train_batch_size=4", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = inspect_path(ckpt)
    assert run.format == "rl-run" and run.latest == "step_2"
    assert [s.name for s in run.steps] == ["step_1", "step_2"]
    assert all(s.complete and not s.reason for s in run.steps)
    rep = inspect_path(ckpt / "step_2")
    assert rep.complete and rep.step == 2 and rep.world_size == 1
    groups = {g.group for g in rep.groups()}
    assert {"model", "optimizer state", "optimizer param groups", "rng", "scheduler", "data"} <= groups
    cov = rep.optimizer
    assert cov.params > 0 and len(cov.full) == cov.params
    assert not cov.none_unexpected and not cov.orphans
    assert rep.config is not None and rep.config_check.startswith("checked")
    assert not [n for n in rep.notes if "manifest says" in n]
