"""`rl train --config FILE` and `rl config show`: a config file sits between the defaults and
the command line (docs/config-reference.md, "Config files").

What is protected: a run's own config.yaml composes back to exactly that run's config (and a
rerun from it trains the same numbers); a partial file changes only its keys, a file's group
choice brings that group's YAML, and command-line overrides win over the file; the file's
mistakes get the errors an override gets, naming the file (exit 2, no traceback); a file never
deletes a run by itself; `rl config show` prints YAML that is itself a config file for the
same config, and imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from engine.config.load import flatten, load_run_config
from engine.errors import ConfigError
from tests.cli_utils import ROOT, cli, flat, rl


def _write(tmp_path, text: str, name: str = "exp.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _squeeze(text: str) -> str:
    """Without any whitespace: a long path wraps inside the error panel wherever the terminal
    width falls (a fresh clone's pytest tmp path is longer than a developer's)."""
    return "".join(text.split())


def _flat(loaded) -> dict:
    return flatten(asdict(loaded.config))


# ---------------------------------------------------------------------------------------------
# Composition: defaults <- file <- command line
# ---------------------------------------------------------------------------------------------

def test_a_partial_file_is_the_same_config_as_the_same_overrides(tmp_path):
    """Keys the file sets are set, every other key is its default: the file and the equivalent
    command line compose the same config, and `changed` lists exactly the file's keys."""
    f = _write(tmp_path, "trainer:\n  total_steps: 7\n  seed: 3\noptim.lr: 1e-3\ntask: add\n")
    from_file = load_run_config(config_file=f)
    from_line = load_run_config(["trainer.total_steps=7", "trainer.seed=3", "optim.lr=1e-3", "task=add"])
    assert asdict(from_file.config) == asdict(from_line.config)
    assert sorted(from_file.changed) == ["optim.lr", "task.name", "trainer.seed", "trainer.total_steps"]
    assert from_file.config.optim.lr == 1e-3  # omegaconf's YAML: `1e-3` is a number, as on the command line
    assert from_file.groups["task"] == "add" and from_file.config_file == f


def test_command_line_overrides_win_over_the_file(tmp_path):
    f = _write(tmp_path, "trainer: {total_steps: 7, seed: 3}\nmodel: {lora: {rank: 4}}\n")
    loaded = load_run_config(["trainer.total_steps=9", "model.lora.rank=16"], config_file=f)
    assert loaded.config.trainer.total_steps == 9 and loaded.config.model.lora.rank == 16
    assert loaded.config.trainer.seed == 3  # the file's other keys still apply


def test_a_group_the_file_picks_brings_its_yaml_under_the_files_values(tmp_path):
    """`model: {preset: smollm2-135m}` composes configs/model/smollm2-135m.yaml (which sets
    optim.lr=2e-6 for pretrained weights), as `model=smollm2-135m` would; a value the file sets
    itself wins over the group's."""
    alone = load_run_config(config_file=_write(tmp_path, "model: {preset: smollm2-135m}\n", "a.yaml"))
    assert alone.config.optim.lr == 2e-6 and alone.groups["model"] == "smollm2-135m"
    own_lr = load_run_config(config_file=_write(tmp_path, "model: {preset: smollm2-135m}\noptim: {lr: 1e-5}\n",
                                                "b.yaml"))
    assert own_lr.config.optim.lr == 1e-5


def test_the_files_engine_is_composed_with_its_keys(tmp_path):
    f = _write(tmp_path, "engine:\n  name: megatron\n  tensor_model_parallel_size: 2\ntrainer: {nprocs: 2}\n")
    loaded = load_run_config(config_file=f)
    assert loaded.config.engine.name == "megatron" and loaded.config.engine.tensor_model_parallel_size == 2
    assert loaded.groups["engine"] == "megatron"
    assert load_run_config(config_file=f, engine="megatron").config.engine.tensor_model_parallel_size == 2


def test_environment_interpolations_in_the_file_resolve_and_stay_unsaved(tmp_path, monkeypatch):
    """`${oc.env:...}` in the file reads the environment at compose time; the value is a secret
    kept as its interpolation (env_refs: config.yaml, `rl config show`), never the value."""
    monkeypatch.setenv("RL_TEST_PROJECT", "s3cret-project")
    f = _write(tmp_path, "trainer:\n  project: ${oc.env:RL_TEST_PROJECT}\n  seed: 5\n"
                         "checkpoint: {dir: '${oc.env:RL_TEST_RUNS,runs}/${trainer.seed}'}\n")
    loaded = load_run_config(config_file=f)
    assert loaded.config.trainer.project == "s3cret-project" and loaded.config.checkpoint.dir == "runs/5"
    assert loaded.env_refs["trainer.project"] == "${oc.env:RL_TEST_PROJECT}"
    r = cli("config", "show", "--config", f)
    assert r.exit_code == 0, r.output
    assert "s3cret-project" not in r.stdout and "${oc.env:RL_TEST_PROJECT}" in r.stdout


# ---------------------------------------------------------------------------------------------
# Mistakes in a file: the override's error, naming the file (exit 2, one paragraph)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expect", [
    ("trainer:\n  total_step: 3\n", "Unknown config key `trainer.total_step`. Did you mean `trainer.total_steps`?"),
    ("trainer:\n  total_steps: abc\n", "`trainer.total_steps` must be an integer; got 'abc'"),
    ("trainer:\n  total_steps: 0\n", "`trainer.total_steps` must be >= 1"),
    ("engine:\n  tensor_model_parallel_size: 2\n", "`engine.tensor_model_parallel_size` has no effect: it is read only with engine=megatron"),
    ("task:\n  path: prompts.jsonl\n", "`task.path=prompts.jsonl` is a dataset key, but the task is the built-in"),
    ("algorithm: {name: grpoo}\n", "`algorithm.name` must be one of"),
    ("trainer: {project: '${nope.x}'}\n", "`trainer.project` refers to `${nope.x}`, which is not a config key"),
    ("data.rollout_n: 4\n", "Unknown config key `data.rollout_n`"),
    # YAML reads nan/inf as text: the overrides' "finite number" refusal, not "must be a number; got 'nan' (str)"
    ("optim: {lr: nan}\n", "`optim.lr` must be a finite number (nan and inf are not); got nan."),
    ("algorithm: {clip_ratio_low: -.inf}\n", "`algorithm.clip_ratio_low` must be a finite number"),
])
def test_a_files_bad_key_or_value_is_the_overrides_error_naming_the_file(tmp_path, text, expect):
    f = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_run_config(config_file=f)
    assert e.value.message.startswith(f"In --config {f}: ") and expect in e.value.message, e.value.message
    r = cli("train", "--config", f)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert _squeeze(f"In --config {f}:") in _squeeze(flat(r.output))


@pytest.mark.parametrize("text,expect", [
    ("- a\n- b\n", "holds a list, not a mapping of config sections"),
    ("just a string\n", "holds a string ('just a string'), not a mapping of config sections"),  # was "Unknown section"
    ("42\n", "holds a number (42), not a mapping of config sections"),  # was "is not valid YAML: " (nothing)
    ("true\n", "holds a true/false value (true), not a mapping"),
    ("trainer: [1\n", "is not valid YAML: line 2, column 1"),
    ("trainer: {seed: 1}\ntrainer: {seed: 2}\n", "is not valid YAML: line 2, column 1: found duplicate key trainer"),
    ("defaults:\n  - task: add\n", "has a Hydra `defaults` list"),
    ("task: addd\n", "`task: addd` is not a known task option. Did you mean `add`?"),
    ("trainer.seed: 1\ntrainer: {seed: 2}\n", "sets `trainer.seed` twice"),
])
def test_a_file_that_is_not_a_config_mapping_is_refused_naming_it(tmp_path, text, expect):
    f = _write(tmp_path, text)
    r = cli("train", "--config", f)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert _squeeze(f"--config {f}") in _squeeze(flat(r.output)) and expect in flat(r.output), flat(r.output)


def test_a_missing_file_or_a_directory_is_refused(tmp_path):
    for path, expect in ((tmp_path / "nope.yaml", "no such file"), (tmp_path, "is a directory, not a YAML file")):
        r = cli("train", "--config", str(path))
        assert r.exit_code == 2 and expect in flat(r.output) and "Traceback" not in r.output, r.output


def test_an_engine_chosen_by_the_file_and_differently_on_the_line_is_a_conflict(tmp_path):
    """`--engine fsdp` (or engine=fsdp) with `engine: {name: megatron}` in the file names both,
    as `--engine fsdp engine=megatron` does; a group on the line that differs from the file's
    (task=sort, file task add) too: the group's YAML and the file's values would mix."""
    f = _write(tmp_path, "engine: {name: megatron}\ntask: add\n")
    for args, line in ((["--engine", "fsdp"], "`--engine fsdp`"), (["engine=fsdp"], "`engine=fsdp`"),
                       (["task=sort"], "`task=sort`")):
        r = cli("train", "--config", f, *args)
        text = flat(r.output)
        assert r.exit_code == 2 and "conflicting overrides" in text, text
        assert _squeeze(f"in `--config {f}`") in _squeeze(text) and line in text and "both choose" in text, text
    assert cli("config", "show", "--config", f, "--engine", "megatron", "task=add").exit_code == 0


def test_a_file_never_deletes_a_run_by_itself(tmp_path):
    """A run's config.yaml records checkpoint.overwrite=true when that run replaced another:
    rerun from the file, it would delete the very run it came from. Only the command line may
    ask for that; either value given there is taken."""
    f = _write(tmp_path, f"checkpoint: {{dir: {tmp_path / 'run'}, overwrite: true}}\n")
    r = cli("train", "--dry-run", "--config", f)
    assert r.exit_code == 2 and "A file cannot ask for that" in flat(r.output), r.output
    assert load_run_config(["checkpoint.overwrite=false"], config_file=f).config.checkpoint.overwrite is False
    assert load_run_config(["checkpoint.overwrite=true"], config_file=f).config.checkpoint.overwrite is True


# ---------------------------------------------------------------------------------------------
# rl config show
# ---------------------------------------------------------------------------------------------

LINE = ["task=add", "optim.lr=1e-3", "trainer.loggers=[console]", "model.lora.target_modules=[q_proj,v_proj]",
        "checkpoint.dir=runs/x y", "--engine", "megatron", "engine.tensor_model_parallel_size=2", "trainer.nprocs=2"]


@pytest.mark.parametrize("diff", [False, True])
def test_config_show_prints_a_config_file_of_the_same_config(tmp_path, diff):
    """What `rl config show` prints (all keys, or only the changed ones) read back with
    --config composes exactly the config it showed."""
    args = ["config", "show", *LINE] + (["--diff-from-defaults"] if diff else [])
    r = cli(*args)
    assert r.exit_code == 0, r.output
    f = _write(tmp_path, r.stdout)
    overrides = [a for a in LINE if "=" in a]
    assert asdict(load_run_config(config_file=f).config) == asdict(load_run_config(overrides, engine="megatron").config)
    if diff:
        assert "lr: 0.001  # default: 0.005" in r.stdout and "name: add  # default: echo" in r.stdout
        assert "total_steps" not in r.stdout  # unchanged keys are left out


def test_config_show_diff_and_json_name_default_and_value(tmp_path):
    f = _write(tmp_path, "trainer: {total_steps: 7}\n")
    r = cli("config", "show", "--config", f, "optim.lr=1e-3", "--diff-from-defaults", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["changed"] == {"optim.lr": {"default": 0.005, "value": 0.001},
                              "trainer.total_steps": {"default": 40, "value": 7}}
    assert doc["config"] == {"optim": {"lr": 0.001}, "trainer": {"total_steps": 7}}
    assert doc["config_file"] == f and doc["groups"]["engine"] == "fsdp"
    full = json.loads(cli("config", "show", "--json").stdout)
    assert full["changed"] == {} and full["config"]["trainer"]["total_steps"] == 40


def test_config_show_errors_are_the_trains_errors():
    r = cli("config", "show", "trainer.total_step=3")
    assert r.exit_code == 2 and "Did you mean `trainer.total_steps`?" in flat(r.output)
    r = cli("config", "show", "--json", "trainer.total_step=3")
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["title"] == "unknown config key"


def test_config_show_imports_no_torch(tmp_path):
    """`rl config show` composes and validates without torch, Ray or transformers (engine/config
    imports no torch: import-linter), so it answers in a fraction of a second."""
    code = ("import sys, json\nsys.argv = ['rl', 'config', 'show', 'task=add', '--diff-from-defaults']\n"
            "from rlcli.main import app\ntry:\n    app()\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'ray', 'transformers', 'vllm', 'megatron'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "name: add  # default: echo" in r.stdout
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


# ---------------------------------------------------------------------------------------------
# A run's own config.yaml reproduces the run
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_runs_config_yaml_reproduces_the_run(tmp_path, monkeypatch):
    """Train a tiny run, then compose its config.yaml with --config: the same config as the
    run's (every key, the environment reference included); `rl train --config` of it into the
    same directory is refused (the run is never replaced unasked), and into another directory
    trains the same numbers, step for step."""
    monkeypatch.setenv("RL_TEST_PROJECT", "proj-a")
    first, second = tmp_path / "first", tmp_path / "second"
    line = ["task=add", "trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=2",
            "optim.lr=2e-3", "trainer.project=${oc.env:RL_TEST_PROJECT}", "trainer.seed=7", f"checkpoint.dir={first}"]
    composed = load_run_config(line)
    r = rl("train", *line, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = first / "config.yaml"
    assert "${oc.env:RL_TEST_PROJECT}" in saved.read_text() and "proj-a" not in saved.read_text()

    again = load_run_config(config_file=str(saved))
    assert asdict(again.config) == asdict(composed.config)
    assert again.env_refs == composed.env_refs and again.groups == composed.groups

    refused = rl("train", "--config", str(saved), timeout=120)
    assert refused.returncode == 2 and "already holds" in flat(refused.stderr), refused.stderr[-2000:]

    r2 = rl("train", "--config", str(saved), f"checkpoint.dir={second}", timeout=300)
    assert r2.returncode == 0, r2.stderr[-3000:]
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (first, second)]
    keys = ("step", "reward_mean", "pg_loss", "response_len_mean", "grad_norm")
    assert [[row[k] for k in keys] for row in rows[0]] == [[row[k] for k in keys] for row in rows[1]]
