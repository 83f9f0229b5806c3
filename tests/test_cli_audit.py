"""Odd inputs found by an adversarial audit of config handling, crash safety and the CLI: each
was a traceback, a silently useless run, a misleading message or non-JSON output under --json.
All in process (typer's CliRunner), no run is started."""

from __future__ import annotations

import json

import pytest

from tests.cli_utils import cli, flat


def _no_traceback(r) -> None:
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)


@pytest.mark.parametrize("dims", [
    ["model.hidden_size=63", "model.num_attention_heads=3", "model.num_key_value_heads=1"],  # head size 21
    ["model.hidden_size=64", "model.num_attention_heads=64", "model.num_key_value_heads=1"],  # head size 1
    ["model.num_attention_heads=3"],   # 64 / 3
    ["model.num_key_value_heads=3"],   # 4 heads / 3 kv heads
])
def test_tiny_model_shape_that_cannot_be_built_is_a_config_error(dims, tmp_path):
    """An odd head size passed `--dry-run` and then failed on the rank with transformers' RoPE
    traceback (exit 1); the divisibility rules were only checked on the rank, after ~10 s."""
    r = cli("train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", *dims)
    _no_traceback(r)
    assert r.exit_code == 2, r.output
    text = flat(r.stderr)
    assert "model.hidden_size" in text and "even head size" in text and "E.g. model.hidden_size=" in text, text
    assert not (tmp_path / "run").exists()


def test_a_tiny_model_shape_that_fits_still_passes(tmp_path):
    r = cli("train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", "model.hidden_size=66",
            "model.num_attention_heads=3", "model.num_key_value_heads=3")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("key", ["optim.lr", "optim.eps", "critic.lr"])
def test_zero_learning_rate_and_epsilon_are_refused(key):
    """optim.eps=0 made AdamW divide 0 by 0 wherever a gradient entry is 0 (NaN weights: the tiny
    model's unused embedding rows); a learning rate of 0 trained nothing, silently."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    ppo = ["algorithm=ppo"] if key.startswith("critic.") else []  # critic.* is read by algorithm=ppo alone
    with pytest.raises(ConfigError) as e:
        load_run_config([*ppo, f"{key}=0"])
    assert f"`{key}` must be > 0.0" in e.value.message and "Default:" in e.value.message
    assert load_run_config([*ppo, f"{key}=1e-9"]).config is not None


def test_list_value_error_shows_the_keys_own_default():
    """`trainer.loggers=console` said "e.g. [0.9,0.99]" (optim.betas' example) and "Default: ...=?"."""
    r = cli("train", "--dry-run", "trainer.loggers=console")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "Default: trainer.loggers=[console,jsonl]" in text, text
    assert "0.99" not in text and "=?" not in text, text


def test_engine_name_override_points_at_the_engine_group():
    """`engine.name=megatron` was refused naming `engine.reshard_after_forward`, a key the user
    never set."""
    r = cli("train", "--dry-run", "engine.name=megatron")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "--engine megatron" in text and "reshard_after_forward" not in text, text


def test_a_phase_cut_short_is_not_reported_finished():
    """Ctrl-C during a checkpoint save printed "saved: <run>/step_N" although only .tmp-step_N
    existed: the finished event was emitted from a finally block."""
    from engine.tracking.progress import phase
    from engine.events import PhaseFinished, PhaseStarted

    events = []
    with pytest.raises(KeyboardInterrupt):
        with phase(events.append, "save_checkpoint", "save checkpoint ckpt/step_2", step=2, poll=lambda: 1):
            raise KeyboardInterrupt
    assert [type(e) for e in events if not type(e).__name__ == "PhaseProgress"] == [PhaseStarted]
    events.clear()
    with phase(events.append, "save_checkpoint", "save checkpoint ckpt/step_3", step=3, poll=lambda: 7):
        pass
    assert isinstance(events[-1], PhaseFinished) and events[-1].bytes == 7


def _run_with_rows(root, rows):
    root.mkdir()
    (root / "run.json").write_text(json.dumps({"format": "rl-run", "version": 1}))
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_plot_draws_values_whose_span_overflows(tmp_path):
    """A diverged run's values (-1e308 .. 1e308) or a step beyond any float made plotext and
    matplotlib fail computing ticks: a traceback from `rl plot`, with or without --png."""
    run = _run_with_rows(tmp_path / "run", [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 1e308},
                                            {"step": 3, "reward_mean": -1e308}, {"step": 10**400, "reward_mean": 0.5}])
    for args in ([], ["--png", str(tmp_path / "out.png")]):
        r = cli("plot", str(run), *args)
        _no_traceback(r)
        assert r.exit_code == 0, r.output
    assert (tmp_path / "out.png").stat().st_size > 0
    r = cli("plot", str(run), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["runs"][0]["values"][1] == 1e308, r.output


def test_plot_of_a_run_without_finite_values_says_so(tmp_path):
    run = _run_with_rows(tmp_path / "run", [{"step": 1}, {"step": 2, "reward_mean": None}])
    r = cli("plot", str(run))
    text = flat(r.stderr)
    assert r.exit_code == 2 and "no finite numbers" in text and "Its metrics: ." not in text, text


@pytest.mark.parametrize("args", [
    ["inspect-ckpt", "/dev/null", "--json"],
    ["inspect-ckpt", "{missing}", "--json"],
    ["train", "--dry-run", "--json", "trainer.total_steps=abc"],
    ["train", "--json", "trainer.total_stpes=3"],
    ["resume", "{missing}", "--dry-run", "--json"],
    ["mem-report", "--estimate", "--json", "model=nonexistent"],
    ["plot", "{missing}", "--json"],
    ["plot", "{empty}", "--json"],
])
def test_json_output_is_json_on_error_too(args, tmp_path):
    """Under --json an error left stdout empty (not a JSON document): scripts piping into jq or
    json.loads failed on the very case they most need to read. The panel still goes to stderr."""
    (tmp_path / "empty").mkdir()
    args = [a.format(missing=tmp_path / "missing", empty=tmp_path / "empty") for a in args]
    r = cli(*args)
    _no_traceback(r)
    assert r.exit_code == 2, r.output
    err = json.loads(r.stdout)["error"]
    assert err["exit_code"] == 2 and err["title"] and err["message"], err
    assert err["message"].split()[0] in "".join(flat(r.stderr).split())  # the panel may wrap a long path


def test_json_error_never_adds_a_second_document(tmp_path):
    """A dry run whose resolved config fails its preflight keeps stdout one document: the
    config and its failed preflight, with the refusal under "error" (the --json error convention)."""
    (tmp_path / "file").write_text("x")
    r = cli("train", "--dry-run", "--json", f"checkpoint.dir={tmp_path / 'file'}")
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)  # one document: the error beside the config and its failed preflight
    assert doc["error"]["exit_code"] == 2 and doc["preflight"]["ok"] is False and "config" in doc, doc
    r = cli("plot", str(tmp_path / "missing"))  # no --json afterwards in the same process: no JSON
    assert r.exit_code == 2 and r.stdout == "", r.output


@pytest.mark.parametrize("overwrite", [True, False])
def test_replacing_a_run_deletes_only_the_runs_own_files(tmp_path, overwrite):
    """A new run replacing an old one (checkpoint.overwrite=true, or an old run without progress
    with no overwrite at all) deleted *every* entry of the directory: the user's notes and an
    `rl export --out run/policy` directory went with the run's files."""
    from engine.config.load import load_run_config
    from engine.trainer.run_dir import RunDir

    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text('{"format": "rl-run", "version": 1}')
    (d / "config.yaml").write_text("trainer: {}\n")
    if overwrite:  # an old run with progress: metrics, a checkpoint, a logger's directory, an aside save
        (d / "metrics.jsonl").write_text('{"step": 1}\n')
        for sub in ("step_1", ".tmp-step_2", "tensorboard", ".superseded-step_3-5"):
            (d / sub).mkdir()
            (d / sub / "x").write_text("x")
    (d / "notes.txt").write_text("mine")
    (d / "policy").mkdir()
    (d / "policy" / "model.safetensors").write_text("weights")
    cfg = load_run_config([f"checkpoint.dir={d}"]).config
    RunDir(d).create(cfg, [], overwrite=overwrite)
    assert (d / "notes.txt").read_text() == "mine" and (d / "policy" / "model.safetensors").exists()
    left = sorted(p.name for p in d.iterdir())
    assert left == ["config.yaml", "notes.txt", "overrides.yaml", "policy", "run.json", "versions.json"], left


def test_checkpoint_dir_with_a_tilde_is_in_the_home(tmp_path, monkeypatch):
    """`'checkpoint.dir=~/runs/a'` made a directory literally named `~` in the current one (model.path
    and task.path expand ~); a later `rm -rf ~...` typed to clean it up is how homes get deleted."""
    from engine.config.load import load_run_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for value in ("'~/runs/a'", '"~/runs/a"'):
        assert load_run_config([f"checkpoint.dir={value}"]).config.checkpoint.dir == str(tmp_path / "home/runs/a")
    assert load_run_config(["checkpoint.dir='runs/~a'"]).config.checkpoint.dir == "runs/~a"  # not leading: kept


def test_an_unquoted_special_character_gets_the_quoting_fix():
    r = cli("train", "--dry-run", "checkpoint.dir=~/runs/a")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "must be quoted" in text and "'checkpoint.dir=\"~/runs/a\"'" in text, text


@pytest.mark.parametrize("field", [{"rank": None}, {"step": float("nan")}, {"peak_rss": "12"},
                                   {"categories": {"params": None}}])
def test_mem_report_of_a_record_with_a_wrong_typed_field_is_a_clean_error(tmp_path, field):
    """A memory.jsonl row with a null rank or a NaN step was a TypeError traceback (sorting the
    phases); it is a damaged file, named with its line and field."""
    d = tmp_path / "run"
    d.mkdir()
    good = {"phase": "rollout", "step": 1, "rank": 0, "device": "cpu", "seconds": 0.1,
            "categories": {"params": 1024}, "rss": 1 << 20, "peak_rss": 1 << 20}
    (d / "memory.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({**good, **field}) + "\n")
    for args in ([], ["--json"]):
        r = cli("mem-report", str(d), *args)
        _no_traceback(r)
        assert r.exit_code == 2 and "line 2" in flat(r.stderr) and next(iter(field)) in flat(r.stderr), r.output
    (d / "memory.jsonl").write_text(json.dumps(good) + "\n")
    assert cli("mem-report", str(d)).exit_code == 0


@pytest.mark.parametrize("args", [
    ["trainer.nprocs=2", "data.train_batch_size=1", "algorithm.rollout_n=1"],
    ["trainer.nprocs=4", "data.train_batch_size=4", "algorithm.rollout_n=2", "algorithm.ppo_mini_batch_size=1"],
])
def test_fewer_sequences_per_update_than_ranks_is_refused(args, tmp_path):
    """A rank with no sequence to train on failed in the rank (`0 rows cannot make 1 micro-batches`,
    a RayTaskError traceback, after the ranks had started); and with fewer prompts than ranks the
    rollout failed first (`range() arg 3 must not be zero`)."""
    r = cli("train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", *args)
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "below the data-parallel ranks" in text and "lower trainer.nprocs" in text, text
    ok = cli("train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", "trainer.nprocs=2",
             "data.train_batch_size=1", "algorithm.rollout_n=2")  # 2 sequences for 2 ranks: fine
    assert ok.exit_code == 0, ok.output


@pytest.mark.slow
def test_held_out_set_smaller_than_the_ranks_validates(tmp_path):
    """task.num_val=1 on 2 ranks: one rank's share of the validation prompts is empty. It raised in
    the sampler (a traceback); merely skipping it hung the other rank in the first forward's FSDP
    all-gather. The empty rank now samples a filler prompt whose output is dropped."""
    from tests.cli_utils import rl

    d = tmp_path / "run"
    r = rl("train", "trainer.nprocs=2", "task.num_val=1", "trainer.val_freq=1", "trainer.total_steps=1",
           "data.train_batch_size=2", "algorithm.rollout_n=2", f"checkpoint.dir={d}", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "validation.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1], rows


@pytest.mark.slow
@pytest.mark.parametrize("to", ["driver", "group"])
def test_sigterm_stops_a_run_like_ctrl_c(tmp_path, to):
    """`kill PID` (or `timeout`, a job scheduler) during a run: Ray's handler printed a stack dump
    ("*** SIGTERM received ... PC: @ ...") and the process exited 15 at once. Now the workers and
    Ray are stopped as on Ctrl-C, the message names the checkpoint to resume, and the exit code is
    143; nothing of the run's process group is left, and the run resumes. ``group``: the signal to
    the whole process group (systemd, a scheduler, `kill -- -PGID`), which reaches the private
    Ray's raylet and GCS too: the driver waited forever to remove the placement group from a
    raylet going down (or Ray's core worker ended it with exit 1 once its GCS was gone)."""
    import os
    import signal
    import subprocess
    import time

    from tests.cli_utils import _rl_argv, _rl_env

    d = tmp_path / "run"
    p = subprocess.Popen(_rl_argv(["train", "--json", "trainer.total_steps=30", "checkpoint.save_freq=1",
                                   "data.train_batch_size=8", "algorithm.rollout_n=4", f"checkpoint.dir={d}"], ""),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_rl_env(None),
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (d / "step_1" / "manifest.json").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.01)
        (os.kill if to == "driver" else os.killpg)(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM)" in err and "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    assert json.loads(out)["error"]["exit_code"] == 143
    time.sleep(1)
    ps = subprocess.run(["ps", "-eo", "pid,pgid"], capture_output=True, text=True).stdout.split("\n")[1:]
    assert not [row for row in ps if row.split()[1:] == [str(p.pid)]], ps
    r = cli("resume", str(d), "--dry-run", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["step"] >= 1, r.output


def test_a_refused_command_line_under_json_is_json_too(capsys):
    """`rl plot --json` (missing argument) or an unknown option: click's usage error went to stderr
    before any command ran, and stdout stayed empty under --json."""
    from rlcli.main import usage_error_json
    from rlcli.output import json_errors

    json_errors(False)  # as at process start: no command ran
    usage_error_json(2, ["plot", "--json"])
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["exit_code"] == 2 and err["title"] == "usage error"
    for code, argv in ((2, ["plot"]), (0, ["plot", "--json"])):  # no --json / not an error: nothing
        json_errors(False)
        usage_error_json(code, argv)
        assert capsys.readouterr().out == ""
    json_errors(True)  # the command ran with --json and reported its own error: no second document
    usage_error_json(2, ["plot", "--json"])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("steps", [[], [".tmp-step_2"], ["step_1"]])
def test_verify_with_nothing_to_verify_fails(tmp_path, steps):
    """`rl inspect-ckpt run/ --verify` on a run without a complete checkpoint (none yet, only an
    unfinished save, a step_N without its manifest) exited 0 having verified nothing, so a
    script's `rl inspect-ckpt run/ --verify && deploy` passed."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text('{"format": "rl-run", "version": 1}')
    for s in steps:
        (d / s).mkdir()
        (d / s / "x").write_text("x")
    r = cli("inspect-ckpt", str(d), "--verify")
    _no_traceback(r)
    assert r.exit_code == 2, r.output
    assert "nothing to verify" in flat(r.stderr), r.output
    assert cli("inspect-ckpt", str(d)).exit_code == 0  # without --verify: the listing, as before


def test_checkpoint_dir_that_would_overwrite_a_users_files_is_refused(tmp_path):
    """A directory that is not a run but holds files under the names a run writes (the user's own
    config.yaml, metrics.jsonl, wandb/) had them overwritten or mixed with the run's; the
    filesystem root was accepted as a run directory."""
    d = tmp_path / "project"
    d.mkdir()
    (d / "config.yaml").write_text("mine: 1\n")
    (d / "wandb").mkdir()
    r = cli("train", "--dry-run", f"checkpoint.dir={d}")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "not an rl run directory" in text and "config.yaml, wandb" in text, text
    assert (d / "config.yaml").read_text() == "mine: 1\n"
    r = cli("train", "--dry-run", "checkpoint.dir=/")
    assert r.exit_code == 2 and "filesystem root" in flat(r.stderr), r.output
    other = tmp_path / "scratch"  # unrelated files do not clash: the run is written beside them
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert cli("train", "--dry-run", f"checkpoint.dir={other}").exit_code == 0


def test_zero_temperature_is_refused_before_the_run():
    """`rollout.temperature=0` was accepted: the sampler clamped it, the trainer's log-probs divided
    the logits by 0, the first update made every weight NaN and step 2's sampler died with an
    IndexError traceback."""
    r = cli("train", "--dry-run", "rollout.temperature=0")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "`rollout.temperature` must be > 0.0" in text, text
    assert cli("train", "--dry-run", "rollout.temperature=0.05").exit_code == 0
    r = cli("train", "--dry-run", "rollout.top_p=0")  # vLLM's SamplingParams raised on the rank
    assert r.exit_code == 2 and "`rollout.top_p` must be > 0.0" in flat(r.stderr), r.output


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "dapo"])
def test_one_sample_per_prompt_with_a_group_baseline_is_refused(algorithm):
    """`algorithm.rollout_n=1` with a group-relative estimator ran to the end learning nothing:
    every group of one has advantage 0 (the loss and gradient are exactly zero)."""
    r = cli("train", "--dry-run", "algorithm.rollout_n=1", f"algorithm={algorithm}")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "a group of one has advantage 0" in text and "algorithm=reinforce_pp" in text, text
    assert cli("train", "--dry-run", "algorithm.rollout_n=1", "algorithm=reinforce_pp").exit_code == 0


@pytest.fixture(scope="module")
def policy_and_critics(tmp_path_factory):
    """A tiny Llama policy, a Qwen2 critic (same tokenizer; q/k/v biases the Llama lacks) and a
    Llama whose vocabulary is smaller than the tokenizer's."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_hf import char_tokenizer, hf_config, save_tiny_model

    root = tmp_path_factory.mktemp("models")
    small = root / "small_vocab"
    AutoModelForCausalLM.from_config(hf_config("llama", 8)).save_pretrained(small)
    char_tokenizer().save_pretrained(small)
    return save_tiny_model("llama", root / "policy"), save_tiny_model("qwen2", root / "critic", seed=1), small


def test_critic_model_path_is_checked_before_the_run(policy_and_critics, tmp_path):
    """`critic.model_path` was never looked at before the ranks built the critic: a path that does
    not exist, or a critic whose embedding has fewer rows than the policy's token ids, passed
    --dry-run and failed inside a rank."""
    policy, critic, small = policy_and_critics
    base = ["train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", "algorithm=ppo", f"model.path={policy}"]
    r = cli(*base, f"critic.model_path={tmp_path / 'nowhere'}")
    _no_traceback(r)
    assert r.exit_code == 2 and "critic.model_path=" in flat(r.stderr) and "does not exist" in flat(r.stderr)
    r = cli(*base, f"critic.model_path={small}")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "has a vocabulary of 8 tokens" in text and "unset critic.model_path" in text, text
    ok = cli(*base, f"critic.model_path={critic}")
    assert ok.exit_code == 0, ok.output


@pytest.mark.slow
def test_ppo_with_a_critic_from_its_own_model_directory_trains(policy_and_critics, tmp_path):
    """No run had ever used `critic.model_path`: the critic is built from that directory (the
    checkpoint holds its Qwen2 q_proj biases, which the Llama policy has none of)."""
    from tests.cli_utils import rl

    policy, critic, _ = policy_and_critics
    r = rl("train", f"checkpoint.dir={tmp_path / 'run'}", "algorithm=ppo", f"model.path={policy}",
           f"critic.model_path={critic}", "trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("inspect-ckpt", str(tmp_path / "run" / "step_2"), "--keys", "*q_proj.bias", "--json")
    names = [t["name"] for t in json.loads(r.stdout)["tensors"]]
    assert names and all(n.startswith("critic.") for n in names), names


def test_megatron_tp_that_does_not_split_the_heads_is_refused_by_the_dry_run(tmp_path):
    """`--engine megatron engine.tensor_model_parallel_size=4` on a model with 2 key/value heads
    passed --dry-run and was refused only after four ranks had started and built megatron."""
    r = cli("train", "--engine", "megatron", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}",
            "engine.tensor_model_parallel_size=4", "trainer.nprocs=4")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "key/value heads (2)" in text and "in {1, 2}" in text, text
    ok = cli("train", "--engine", "megatron", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}",
             "engine.tensor_model_parallel_size=2", "trainer.nprocs=2")
    assert ok.exit_code == 0, ok.output


def test_lora_targets_that_name_no_linear_layer_are_refused_before_the_run(tmp_path):
    """`model.lora.target_modules=[foo]` passed --dry-run and died on the rank with peft's
    NoMatchingPeftModuleError traceback; `model.lora.alpha=0` scaled every adapter to nothing."""
    base = ["train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", "model.lora.rank=4"]
    for targets, said in (("[foo]", "`foo` is the name of no module"), ("[q_proj,mlp]", "`mlp` is a module that is not")):
        r = cli(*base, f"model.lora.target_modules={targets}")
        _no_traceback(r)
        text = flat(r.stderr)
        assert r.exit_code == 2 and said in text and "Its linear layers: down_proj" in text, text
    assert cli(*base, "model.lora.target_modules=[self_attn.q_proj,v_proj]").exit_code == 0  # peft's dotted suffix
    r = cli(*base, "model.lora.alpha=0")
    assert r.exit_code == 2 and "`model.lora.alpha` must be > 0.0" in flat(r.stderr), r.output


def test_ctrl_c_in_any_command_is_exit_130_with_one_line_or_one_json_document(capsys):
    """`rl export` / `rl eval` stopped by Ctrl-C printed nothing (under --json, stdout stayed empty,
    though every other exit prints one JSON document); `rl train` says more itself (where to resume)."""
    import typer

    from rlcli.output import call_engine, interrupts_reported_by_caller, json_errors

    def stopped():
        raise KeyboardInterrupt

    json_errors(True)
    try:
        with pytest.raises(typer.Exit) as e:
            call_engine(stopped)
    finally:
        json_errors(False)
    assert e.value.exit_code == 130
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == {"title": "interrupted", "exit_code": 130,
                                        "message": json.loads(out)["error"]["message"]}
    assert "Ctrl-C" in err
    with interrupts_reported_by_caller(), pytest.raises(KeyboardInterrupt):
        call_engine(stopped)
