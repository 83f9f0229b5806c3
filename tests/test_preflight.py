"""Bad input ends in one clear paragraph and exit 2, before any run directory exists (issue 19,
finding 6 / required 6): override syntax, interpolations, values the workers would crash on,
missing extras, reward functions, model paths, unusable checkpoint directories."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_utils import cli, flat, rl_concurrently


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default checkpoint.dir (ckpt/) lands here, if anywhere


def refused(r, *needles: str) -> str:
    """Exit 2, no traceback, every needle in the message; returns the flattened message."""
    text = flat(r.stderr)
    assert r.exit_code == 2, (r.exit_code, r.stdout[-2000:], r.stderr[-2000:], r.exception)
    assert "Traceback" not in r.stdout + r.stderr
    for n in needles:
        assert n in text, (n, text)
    return text


@pytest.mark.parametrize("override, needle", [
    ("", "is not an override"),
    ("=5", "has no key"),
    ("~", "is not an override"),
    ("++", "is not an override"),
])
def test_malformed_override_is_exit_2(override, needle, tmp_path):
    """`rl train ""` was an IndexError in the override parser."""
    refused(cli("train", "--dry-run", override), needle)
    refused(cli("train", override), needle)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("override, needles", [
    ("trainer.total_steps=${oc.env:RL_TEST_UNSET_X}", ["RL_TEST_UNSET_X", "not set", "trainer.total_steps"]),
    ("trainer.total_steps=${nonexistent.key}", ["nonexistent.key", "not a config key"]),
    ("checkpoint.dir=${hydra:runtime.cwd}", ["hydra:", "checkpoint.dir"]),
    ("checkpoint.dir=${unknownresolver:x}", ["unknownresolver"]),
])
def test_unresolvable_interpolation_is_exit_2(override, needles, tmp_path, monkeypatch):
    """Interpolations that cannot be resolved were omegaconf tracebacks (exit 1)."""
    monkeypatch.delenv("RL_TEST_UNSET_X", raising=False)
    refused(cli("train", "--dry-run", override), *needles)
    refused(cli("train", override), *needles)
    assert not (tmp_path / "ckpt").exists()


def test_env_interpolation_with_value_resolves(monkeypatch):
    monkeypatch.setenv("RL_TEST_PROMPT_KEY", "question")
    r = cli("train", "--dry-run", "--json", "trainer.project=${oc.env:RL_TEST_PROMPT_KEY}")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    # shown as written: a value read from the environment is never printed or saved resolved
    assert out["config"]["trainer"]["project"] == "${oc.env:RL_TEST_PROMPT_KEY}"
    assert "question" not in r.stdout


@pytest.mark.parametrize("override, needles", [
    ("optim.lr=nan", ["optim.lr", "finite"]),
    ("optim.lr=inf", ["optim.lr", "finite"]),
    ("optim.eps=inf", ["optim.eps", "finite"]),
    ("trainer.ray_timeout_s=1e999", ["trainer.ray_timeout_s", "finite"]),
    ("optim.betas=[a,b]", ["optim.betas", "finite numbers"]),
    ("optim.betas=[0.9]", ["optim.betas", "exactly 2"]),
    ("optim.betas=[0.9,0.99,0.999]", ["optim.betas", "exactly 2"]),
    ("optim.betas=[0.9,1.0]", ["optim.betas", "< 1.0"]),
    ("optim.betas=[-0.1,0.9]", ["optim.betas", ">= 0.0"]),
    ("trainer.seed=99999999999999999999999", ["trainer.seed", "<= 4294967295"]),
    ("trainer.seed=-1", ["trainer.seed", ">= 0"]),
    ("trainer.total_steps=99999999999999999999999", ["trainer.total_steps", "64 bits"]),
    ("task.num_train=10000000000", ["task.num_train", "<="]),
])
def test_values_the_workers_would_crash_on_are_refused(override, needles, tmp_path):
    """`--dry-run` accepted these and the ranks then crashed with a Ray traceback, leaving a run
    directory that blocked the retry."""
    refused(cli("train", "--dry-run", override), *needles)
    refused(cli("train", override), *needles)
    assert not (tmp_path / "ckpt").exists()


def test_valid_betas_and_seed_still_accepted():
    r = cli("train", "--dry-run", "--json", "optim.betas=[0.0,0.999]", "trainer.seed=4294967295")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["config"]["optim"]["betas"] == [0.0, 0.999]


def _prompt_file(d: Path) -> Path:
    p = d / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"say {w}:", "answer": w}) for w in ["hi", "ok"] * 8) + "\n")
    return p


def test_reward_fn_with_incompatible_signature_is_refused(tmp_path):
    """`task.reward_fn=os:system` imported fine and then crashed on the first reward call."""
    p = _prompt_file(tmp_path)
    args = ["task=jsonl", f"task.path={p}", "task.reward_fn=os:system"]
    refused(cli("train", "--dry-run", *args), "os:system")
    refused(cli("train", *args), "os:system")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("source", [
    "def score(prompt, response, answer):\n    return 1.0\n",
    "def score(prompt, response, answer, **kwargs):\n    return 1.0\n",
    "def score(*args):\n    return 1.0\n",
])
def test_reward_fn_with_compatible_signature_passes_preflight(source, tmp_path):
    (tmp_path / "rl_test_rewards_ok.py").write_text(source)
    p = _prompt_file(tmp_path)
    r = cli("train", "--dry-run", "--json", "task=jsonl", f"task.path={p}",
            "task.reward_fn=rl_test_rewards_ok:score")
    import sys
    sys.modules.pop("rl_test_rewards_ok", None)
    assert r.exit_code == 0, r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["preflight"]["checks"]}
    assert checks["reward function"]["ok"] is True


def test_reward_fn_on_a_builtin_task_is_refused_not_ignored(tmp_path):
    """A built-in task scores with its own rule; task.reward_fn was silently ignored."""
    refused(cli("train", "--dry-run", "task=add", "task.reward_fn=mymod:score"), "task.reward_fn=mymod:score",
            "task=add", "ignored")
    # task.reward_weights weights task.reward_fns: a built-in task has none, and the weights were silently ignored
    refused(cli("train", "--dry-run", "task=add", "task.reward_weights=[1,2]"), "task.reward_weights=[1,2]",
            "task=add", "silently ignored", "task=dataset")
    refused(cli("train", "--dry-run", "task=add", "task.reward_fns=[mymod:a]"), "`task.reward_fns=mymod:a`")


def test_missing_model_path_is_exit_2(tmp_path):
    """`rl train model.path=/models/Qwen2.5-0.5B` (absent) was a 290-line traceback."""
    text = refused(cli("train", "--dry-run", f"model.path={tmp_path}/models/Qwen2.5-0.5B"))
    assert "model.path" in text or "Qwen2.5-0.5B" in text
    assert not (tmp_path / "ckpt").exists()


def test_megatron_without_megatron_core_names_the_extra(tmp_path):
    """Without megatron-core (hidden in a real subprocess), `--engine megatron` was a Ray
    traceback that left a run directory; now exit 2 naming the extra, nothing created."""
    hide = "sys.modules['megatron'] = None"
    runs = {tmp_path / "dry": ["train", "--engine", "megatron", "--dry-run"],
            tmp_path / "run": ["train", "--engine", "megatron", "trainer.total_steps=1"]}
    results = rl_concurrently(*([*args, f"checkpoint.dir={d}"] for d, args in runs.items()), pre=hide, cwd=tmp_path,
                              timeout=300)  # independent: each its own checkpoint.dir
    for d, r in zip(runs, results):
        assert r.returncode == 2, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert "pip install 'rl[megatron]'" in flat(r.stderr)
        assert not d.exists()


def test_error_text_is_not_eaten_by_rich_markup(tmp_path):
    """`pip install 'rl[smollm2]'` was shown as `pip install 'rl'`: brackets are literal text."""
    r = cli("train", "--dry-run", "checkpoint.dir=/proc/[smollm2]/x")
    refused(r, "/proc/[smollm2]/x")

    import typer

    from rlcli.output import fail

    from typer.testing import CliRunner

    app = typer.Typer()

    @app.command()
    def boom() -> None:
        fail("install it: pip install 'rl[smollm2]'", title="missing [bold]dependency")

    out = CliRunner().invoke(app, [])
    assert out.exit_code == 2
    assert "pip install 'rl[smollm2]'" in flat(out.stderr)
    assert "missing [bold]dependency" in flat(out.stderr)


# ---- the checkpoint directory -------------------------------------------------------------
@pytest.mark.parametrize("where, needle", [
    ("/proc/rl-test-x", "cannot be written"),
    ("FILE/sub", "which is a file"),
    ("FILE", "is a file"),
])
def test_unusable_checkpoint_dir_is_exit_2(where, needle, tmp_path):
    """`checkpoint.dir=/proc/x` or a path under a file were raw OSError tracebacks."""
    f = tmp_path / "afile"
    f.write_text("x")
    target = where.replace("FILE", str(f))
    refused(cli("train", "--dry-run", f"checkpoint.dir={target}"), needle)
    refused(cli("train", f"checkpoint.dir={target}"), needle)
    assert f.read_text() == "x" and not Path("/proc/rl-test-x").exists()


@pytest.mark.parametrize("where, needle", [
    ("RUN/step_2", "is the checkpoint"),
    ("RUN/step_2/nested", "is inside the checkpoint"),
    ("RUN/.tmp-step_3", "is the checkpoint"),
    ("LOOP", "loops through symbolic links"),
    ("DANGLING", "is a symbolic link to"),
])
def test_checkpoint_dir_inside_a_checkpoint_or_through_a_bad_link_is_exit_2(where, needle, tmp_path):
    """checkpoint.dir=ckpt/step_2 (even with overwrite=true) passed --dry-run and a real run then
    wrote its config, metrics and checkpoints into another run's saved checkpoint; a symlink loop
    passed --dry-run (its parent was probed instead). Both are refused, dry run or not, and the
    existing run is left exactly as it was."""
    from tests.ckpt_tools import tree_state

    run = tmp_path / "run"
    (run / "step_2" / "state").mkdir(parents=True)
    (run / "step_2" / "manifest.json").write_text("{}")
    (run / ".tmp-step_3").mkdir()
    (run / "run.json").write_text("{}")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    target = where.replace("RUN", str(run)).replace("LOOP", str(tmp_path / "loop_a")).replace(
        "DANGLING", str(tmp_path / "dangling"))
    before = tree_state(tmp_path)
    refused(cli("train", "--dry-run", f"checkpoint.dir={target}"), needle)
    refused(cli("train", f"checkpoint.dir={target}", "checkpoint.overwrite=true"), needle)
    assert tree_state(tmp_path) == before



@pytest.mark.parametrize("kind", ["symlink", "fifo", "tensorboard_link"])
def test_run_files_that_are_links_or_fifos_are_refused_before_the_run(kind, tmp_path):
    """A directory whose metrics.jsonl is a symlink to another file had `rl train` append every
    row to that file (a FIFO would make the first row wait forever). The preflight refuses, dry
    run or not, naming the file; the file it points at is untouched and nothing is created."""
    import os

    from tests.ckpt_tools import tree_state

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    if kind == "symlink":
        (run / "metrics.jsonl").symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(run / "metrics.jsonl")
    else:  # a logger's directory pointing elsewhere: event files would be written there
        (tmp_path / "elsewhere").mkdir()
        (run / "tensorboard").symlink_to(tmp_path / "elsewhere")
    before = tree_state(tmp_path)
    needle = "is a FIFO" if kind == "fifo" else "is a symbolic link"
    refused(cli("train", "--dry-run", f"checkpoint.dir={run}"), needle, "Move it out of")
    refused(cli("train", f"checkpoint.dir={run}", "trainer.total_steps=1"), needle, "Move it out of")
    assert tree_state(tmp_path) == before and victim.read_text() == "keep me\n"


def test_rows_are_never_appended_through_a_link_or_into_a_fifo(tmp_path):
    """The one writer of every run's row files (engine/user_paths.append_to_run_file) refuses a
    symlink (O_NOFOLLOW) and a FIFO (opened non-blocking: no wait), and appends whole rows to a
    regular file: the last guard if a file is swapped for a link while a run goes on."""
    import os

    from engine.errors import UserError
    from engine.tracking.jsonl_logger import append_line

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (tmp_path / "link.jsonl").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo.jsonl")
    for name, what in (("link.jsonl", "symbolic link"), ("fifo.jsonl", "FIFO")):
        with pytest.raises(UserError, match=what):
            append_line(tmp_path / name, '{"step": 1}')
    assert victim.read_text() == "keep me\n"
    append_line(tmp_path / "m.jsonl", '{"step": 1}')
    append_line(tmp_path / "m.jsonl", '{"step": 2}')
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


def _mount_tmpfs(path: Path, size: str, *opts: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    o = ",".join((f"size={size}",) + opts)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", o, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def mount_tmpfs(tmp_path):
    mounted = []

    def mount(name: str, size: str, *opts: str) -> Path:
        p = tmp_path / name
        if not _mount_tmpfs(p, size, *opts):
            pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): no real full or read-only "
                        "file system to test against")
        mounted.append(p)
        return p

    yield mount
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def test_read_only_file_system_is_exit_2_before_anything_starts(mount_tmpfs):
    ro = mount_tmpfs("ro", "1m", "ro")
    text = refused(cli("train", f"checkpoint.dir={ro}/run"), "read-only")
    assert "checkpoint.dir" in text
    refused(cli("train", "--dry-run", f"checkpoint.dir={ro}/run"), "read-only")


def test_full_disk_is_exit_2_naming_the_space_needed(mount_tmpfs):
    """A file system without room for one checkpoint (estimated from the parameter count)."""
    small = mount_tmpfs("small", "256k")
    text = refused(cli("train", f"checkpoint.dir={small}/run"), "free", "one checkpoint needs about")
    assert "checkpoint.dir" in text
    assert list(small.iterdir()) == []


def test_dry_run_json_reports_preflight_and_is_standard_json():
    r = cli("train", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    names = [c["name"] for c in out["preflight"]["checks"]]
    assert names == ["extras", "device", "reward function", "model and task", "host memory", "run directory"]
    assert out["preflight"]["ok"] is True and out["preflight"]["estimated_checkpoint_bytes"] > 0
    assert not os.path.exists("ckpt")  # the writability probe leaves nothing


def test_row_append_on_a_full_disk_leaves_no_half_row(mount_tmpfs):
    """metrics.jsonl rows (and the run's other .jsonl rows) are appended in one unbuffered write
    that is cut back when the disk is full: the file keeps only whole rows."""
    from engine.tracking.jsonl_logger import JsonlLogger
    from engine.trainer.run_dir import append_line

    fs = mount_tmpfs("full", "64k")
    logger = JsonlLogger(fs)
    logger.write_step({"step": 1})
    append_line(fs / "memory.jsonl", '{"step": 1}')
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    (fs / "filler").write_bytes(b"\0" * (free - 16384))  # 16 KiB left: part of the next row fits
    big = {"step": 2, "pad": "x" * 65536}
    with pytest.raises(OSError):
        logger.write_step(big)
    with pytest.raises(OSError):
        append_line(fs / "memory.jsonl", json.dumps(big))
    assert (fs / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (fs / "memory.jsonl").read_text() == '{"step": 1}\n'


def test_every_builtin_task_refuses_a_reward_fn():
    """Each built-in task (the registry's list, so a new one is covered) refuses task.reward_fn
    instead of silently ignoring it."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError
    from engine.config.schema import BUILTIN_TASKS
    from engine.trainer.preflight import check_reward

    assert "sort" in BUILTIN_TASKS
    for name in BUILTIN_TASKS:
        cfg = load_run_config([f"task={name}", "task.reward_fn=rl:exact_match"]).config
        with pytest.raises(ConfigError, match="does not apply to the built-in task"):
            check_reward(cfg, resume=False)


def test_more_local_ranks_than_host_memory_holds_is_refused(tmp_path, monkeypatch):
    """`trainer.nprocs=64` on a laptop started 64 Ray actors that each import torch (~0.4 GiB
    apiece): the machine swapped until the OOM killer took a rank. A private local Ray's ranks
    are now checked against MemAvailable first; a joined cluster's are not (they are elsewhere)."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError
    from engine.trainer.preflight import check_host_memory
    from engine.trainer.setup import prepare_inputs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the suite's own session cluster: a local run here
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8000000 kB\nMemAvailable:    4000000 kB\n")  # ~3.8 GiB available
    cfg = load_run_config(["trainer.nprocs=16"]).config
    with pytest.raises(ConfigError) as e:
        check_host_memory(cfg, prepare_inputs(cfg), meminfo=str(meminfo))
    assert "trainer.nprocs=16" in e.value.message and "Lower trainer.nprocs (at most ~" in e.value.message
    ok = load_run_config(["trainer.nprocs=2"]).config
    assert "available" in check_host_memory(ok, prepare_inputs(ok), meminfo=str(meminfo))
    joined = load_run_config(["trainer.nprocs=16", "trainer.ray_address=10.0.0.1:6379"]).config
    assert "not checked" in check_host_memory(joined, prepare_inputs(joined), meminfo=str(meminfo))


def test_a_pretrained_model_does_not_silently_train_at_the_tiny_models_learning_rate(tmp_path):
    """optim.lr's default (5e-3) is the tiny random-init model's; `model=smollm2-135m` trained at
    it and two steps later answered "3 times 4" with "44\\n4444...". The preset now brings its
    own rate, and a model.path of pretrained size at the tiny default gets a warning."""
    from engine.config.load import load_run_config
    from engine.trainer.preflight import estimated_params, pretrained_lr_note
    from engine.trainer.setup import RunInputs
    from tests.tiny_hf import save_tiny_model

    assert load_run_config(["model=smollm2-135m"]).config.optim.lr == 2e-6
    assert load_run_config(["model=smollm2-135m", "optim.lr=1e-5"]).config.optim.lr == 1e-5  # overrides win
    assert load_run_config([]).config.optim.lr == 5e-3
    d = save_tiny_model("llama", tmp_path / "m")
    from transformers import AutoModelForCausalLM

    exact = AutoModelForCausalLM.from_pretrained(d).num_parameters()
    inputs = RunInputs(None, None, [], [], str(d), {"size": 12, "pad": 0, "eos": 1}, None)
    assert estimated_params(load_run_config([]).config, inputs) == exact  # from the safetensors header
    cfg = load_run_config([f"model.path={d}"]).config
    assert "optim.lr=0.005 is the tiny built-in model's default" in pretrained_lr_note(cfg, 135_000_000)
    assert pretrained_lr_note(cfg, exact) == ""  # a tiny random-init HF model: 5e-3 is right
    assert pretrained_lr_note(load_run_config([f"model.path={d}", "optim.lr=1e-6"]).config, 135_000_000) == ""


def test_a_length_normalised_loss_gets_a_note_when_responses_end_at_eos():
    """loss_agg_mode=seq-mean-token-mean weighs a token by 1/length of its response, which pushes
    EOS down hardest on short low-reward responses (issue 39): the run is told before it starts.
    Fixed-length responses (ignore_eos) and the default token-mean get no note."""
    from engine.config.load import load_run_config
    from engine.trainer.preflight import length_normalised_loss_note

    note = length_normalised_loss_note(load_run_config(["algorithm.loss_agg_mode=seq-mean-token-mean"]).config)
    assert "1/length" in note and "token-mean, the default" in note
    assert length_normalised_loss_note(load_run_config([]).config) == ""
    assert length_normalised_loss_note(load_run_config(["algorithm.loss_agg_mode=seq-mean-token-sum"]).config) == ""
    assert length_normalised_loss_note(load_run_config(["algorithm.loss_agg_mode=seq-mean-token-mean",
                                                        "rollout.ignore_eos=true"]).config) == ""
