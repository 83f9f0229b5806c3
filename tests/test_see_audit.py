"""Odd inputs found by an adversarial audit of what shows a run: `rl plot`, the loggers'
config, `rl mem-report` on run directories, `rl env`. Each was a traceback, a process abort, a
misleading or late error, or a value made up. In process (typer's CliRunner) except where a
subprocess is the only way to survive the old failure; no run is started."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from tests.cli_utils import cli, flat, rl


def _no_traceback(r) -> None:
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)


def _plot_json(*args) -> dict:
    r = cli("plot", *args, "--json")
    _no_traceback(r)
    return json.loads(r.stdout)


# ---- rl plot: damaged rows ---------------------------------------------------------------------
def test_a_nested_field_that_is_not_an_object_is_skipped(tmp_path):
    """A metrics.jsonl row whose `timing`, `algo` or `mem_peaks` is not an object (an edited or
    damaged row: "timing": "x") was an AttributeError traceback from `rl plot` (exit 1)."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "reward_mean": 0.1, "timing": "x"}\n{"step": 2, "reward_mean": 0.2, "algo": [1, 2]}\n'
        '{"step": 3, "reward_mean": 0.3, "mem_peaks": 5, "timing": {"rollout": 1.5}}\n')
    d = _plot_json(str(tmp_path))
    assert d["runs"][0]["steps"] == [1, 2, 3] and d["runs"][0]["values"] == [0.1, 0.2, 0.3], d
    d = _plot_json(str(tmp_path), "--metric", "perf/time/rollout")
    assert d["runs"][0]["steps"] == [3], d


def test_validation_rows_with_null_text_or_missing_values_are_skipped(tmp_path):
    """validation.jsonl rows with `reward: null` (TypeError) or `accuracy: "x"` (ValueError) were
    tracebacks from `rl plot`; a row without `reward` was drawn as val/reward 0.0, a value the run
    never logged."""
    (tmp_path / "validation.jsonl").write_text(
        '{"step": 0, "accuracy": "x", "reward": 0.2}\n{"step": 1, "reward": null, "accuracy": 0.5}\n'
        '{"step": 2, "accuracy": 0.6}\n{"step": 3, "accuracy": 0.7, "reward": 0.4}\n')
    d = _plot_json(str(tmp_path), "--metric", "val/reward")
    assert d["runs"][0]["steps"] == [0, 3] and d["runs"][0]["values"] == [0.2, 0.4], d
    d = _plot_json(str(tmp_path), "--metric", "val/accuracy")
    assert d["runs"][0]["steps"] == [1, 2, 3], d


def test_nan_in_validation_rows_is_not_drawn(tmp_path):
    """NaN/Infinity in validation.jsonl went into the series (null points in --json) and plotext
    aborted the process drawing them (`std::bad_alloc`, exit 134, no message at all). Run as a
    subprocess: the old failure killed the process that drew."""
    (tmp_path / "validation.jsonl").write_text(
        '{"step": 0, "accuracy": 0.1, "reward": NaN}\n{"step": 1, "accuracy": Infinity, "reward": 0.3}\n'
        '{"step": 2, "accuracy": 0.3, "reward": 0.4}\n')
    d = _plot_json(str(tmp_path), "--metric", "val/reward")
    assert d["runs"][0]["steps"] == [1, 2] and None not in d["runs"][0]["values"], d
    r = rl("plot", str(tmp_path), "--metric", "val/reward", "--width", "50", "--height", "10", timeout=120)
    assert r.returncode == 0 and "val/reward" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_nan_in_validation_rows_is_not_sent_to_the_loggers():
    """The loggers get val/ metrics through the same function: a non-finite validation score is
    left out as step metrics are (TensorBoard and MLflow got NaN; a null reward was a TypeError)."""
    from engine.tracking.names import validation_metrics

    assert validation_metrics(0.5, float("nan")) == {"val/accuracy": 0.5}
    assert validation_metrics(None, None) == {}
    assert validation_metrics(0.25, 0.5) == {"val/reward": 0.5, "val/accuracy": 0.25}


# ---- rl plot: a long run -----------------------------------------------------------------------
def _long_metrics(path, steps: int) -> None:
    row = {"reward_mean": 0.5, "accuracy": 0.1, "pg_loss": -0.1, "entropy": 2.4, "grad_norm": 0.8, "lr": 0.005,
           "timing": {p: 0.01 for p in ("rollout", "reward", "log_probs", "update", "offload")},
           "mem_peaks": {f"c{i}_bytes": 1000 + i for i in range(8)},
           "micro_batch_shapes": [[8, 14]] * 32, "algo": {f"x{i}": 0.1 for i in range(6)}}
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, **row, "reward_mean": s / steps}) + "\n")


def test_plotting_one_metric_does_not_hold_the_whole_file(tmp_path):
    """`rl plot` (and the end-of-run chart) read metrics.jsonl whole and kept every parsed row
    with every metric: ~1.3 GB of memory for a 100k-step run's 135 MB file. The rows are read
    one at a time and only the metric drawn is kept: the peak stays well under the file's size."""
    from engine.tracking.series import load_series

    mf = tmp_path / "metrics.jsonl"
    _long_metrics(mf, 4000)
    size = mf.stat().st_size
    tracemalloc.start()
    try:
        s = load_series(tmp_path, "train/reward")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(s.steps) == 4000 and s.values[-1] == 1.0
    assert peak < size / 2, f"peak {peak} bytes reading a {size}-byte metrics.jsonl"


def test_terminal_chart_of_a_long_run_draws_a_bounded_number_of_points():
    """plotext drew every point of a long run: 100k steps took ~700 MB and seconds for a chart
    ~70 columns wide. Thinned to the lowest and highest point of each of 2 x width runs of
    points, keeping spikes and both ends; --json keeps every point."""
    from rlcli.render.plot import thinned

    steps = list(range(1, 100_001))
    values = [0.5] * len(steps)
    values[54_321] = 9.0     # a spike
    values[77_777] = -3.0    # a dip
    xs, ys = thinned(steps, values, 120)
    assert len(xs) <= 2 * 120 + 2 and xs == sorted(xs)
    assert xs[0] == 1 and xs[-1] == 100_000
    assert 9.0 in ys and -3.0 in ys
    assert thinned([1, 2, 3], [1.0, 2.0, 3.0], 120) == ([1, 2, 3], [1.0, 2.0, 3.0])


# ---- paths and values shown as they are, never as rich markup -----------------------------------
def test_run_paths_with_brackets_are_shown_not_read_as_markup(tmp_path, monkeypatch):
    """A run directory `c[/]` (`]` inside `c[`) made `rl plot --list` and `rl mem-report` a rich MarkupError
    traceback (exit 1), and `b[red]` was shown as `b`; `--png 'x[/].png'` failed the same way
    after the PNG was written, and `--list` on a row with a nested key `[/]` too."""
    for name in ("c[/]", "b[red]"):
        run = tmp_path / name
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.1}\n{"step": 2, "reward_mean": 0.2}\n')
        (run / "config.yaml").write_text("trainer: {total_steps: 1}\n")
        (run / "memory.jsonl").write_text('{"phase": "update", "step": 1, "rank": 0}\n')
    a, b = str(tmp_path / "c[/]"), str(tmp_path / "b[red]")
    monkeypatch.setenv("COLUMNS", "400")  # long tmp paths on one line
    r = cli("plot", a, b, "--list")
    _no_traceback(r)
    assert r.exit_code == 0 and "c[/]:" in r.stdout and "b[red]:" in r.stdout, r.output
    (tmp_path / "b[red]" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.1, "timing": {"[/]": 1.0}}\n')
    r = cli("plot", b, "--list")  # a metric name from the file, also not markup
    _no_traceback(r)
    assert r.exit_code == 0 and "perf/time/[/]" in r.stdout, r.output
    r = cli("plot", a, "--png", str(tmp_path / "c[/]" / "x[/].png"))
    _no_traceback(r)
    assert r.exit_code == 0 and "x[/].png" in flat(r.stdout), r.output
    r = cli("mem-report", a)
    _no_traceback(r)
    assert r.exit_code == 0 and "c[/]" in r.stdout, r.output


def test_env_values_with_brackets_are_shown_not_read_as_markup(monkeypatch):
    """`OMP_NUM_THREADS='[/]' rl env` was a MarkupError traceback, and CUDA_VISIBLE_DEVICES='[x]'
    was shown as `CUDA_VISIBLE_DEVICES=` (the value eaten as a tag)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "[/]")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "[x]")
    r = cli("env", "--no-torch")
    _no_traceback(r)
    assert r.exit_code == 0 and "OMP_NUM_THREADS=[/]" in r.stdout and "CUDA_VISIBLE_DEVICES=[x]" in r.stdout, \
        r.output


def test_run_summary_and_plan_show_bracketed_paths():
    """checkpoint.dir="runs/[/]" (quoted, a valid path) made the plan and the end-of-run summary a
    MarkupError traceback: the run directory, metrics file, loggers' places and checkpoints were
    read as rich markup."""
    from rich.console import Console

    from rlcli.render.train import plan_table, summary_table

    run = "runs/[/]x[red]"
    s = SimpleNamespace(first_step=1, last_step=3, steps_run=3, reward_first10=0.1, improvement=None,
                        reward_last10=0.2, val_before=None, val_after=None, alarms=[], stopped_by_alarm=None,
                        wall_time_s=1.0, metrics_path=f"{run}/metrics.jsonl",
                        tracking={"where": {"tensorboard": f"{run}/tensorboard"}}, checkpoints=[f"{run}/step_3"])
    plan = SimpleNamespace(engine="fsdp", ranks=1, dp_size=1, device="cpu", model="/models/[/]m", num_params=10,
                           task="echo", num_train=1, num_val=1, data="", reward="", rollout="torch", start_step=0,
                           total_steps=3, key_settings={}, changed={}, changed_from="default", run_dir=run, ray="",
                           placement=[])
    console = Console(width=200, record=True, color_system=None)
    console.print(summary_table(s))
    console.print(plan_table(plan))
    text = console.export_text()
    assert f"{run}/metrics.jsonl" in text and f"{run}/tensorboard" in text and f"{run}/step_3" in text, text
    assert run in text and "/models/[/]m" in text, text


# ---- loggers: names and settings ---------------------------------------------------------------
def test_a_logger_name_in_capitals_gets_did_you_mean():
    """`trainer.loggers=[console,JSONL]` listed the loggers but offered no "did you mean"."""
    r = cli("train", "--dry-run", "trainer.loggers=[console,JSONL]")
    _no_traceback(r)
    assert r.exit_code == 2 and "Did you mean `jsonl`?" in flat(r.stderr), r.output


def test_wandb_mode_and_project_names_the_loggers_refuse_fail_at_config_time(monkeypatch):
    """WANDB_MODE=bogus, a trainer.project wandb refuses (`a/b`) or an empty one MLflow refuses
    passed `--dry-run`; the real run built the model and started the ranks, then stopped at its
    first event with wandb's pydantic ValidationError text. Now refused with the config, exit 2."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    monkeypatch.setenv("WANDB_MODE", "bogus")
    r = cli("train", "--dry-run", "trainer.loggers=[console,jsonl,wandb]")
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "WANDB_MODE='bogus' is not a wandb mode" in text and "offline" in text, text
    assert load_run_config(["trainer.loggers=[console,jsonl]"]).config is not None  # not wandb's business
    monkeypatch.setenv("WANDB_MODE", "Offline")
    with pytest.raises(ConfigError) as e:
        load_run_config(["trainer.loggers=[wandb]"])
    assert "Did you mean `offline`?" in e.value.message
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(ConfigError) as e:
        load_run_config(["trainer.loggers=[wandb]", "trainer.project=team/exp"])
    assert "`trainer.project` 'team/exp' contains '/'" in e.value.message
    with pytest.raises(ConfigError) as e:
        load_run_config(["trainer.loggers=[mlflow]", "trainer.project=''"])
    assert "MLflow needs an experiment name" in e.value.message
    assert load_run_config(["trainer.loggers=[wandb,mlflow]", "trainer.project=my-exp"]).config is not None


def test_a_saved_config_naming_a_logger_not_installed_here_can_drop_it(monkeypatch, tmp_path):
    """`rl resume` of a run logged to wandb, on a machine without wandb, was refused as "The
    config saved in .../manifest.json no longer validates ... Resume it with the rl version that
    wrote it", even with trainer.loggers=[console,jsonl] dropping wandb: the saved config was
    checked against this machine's packages before the overrides applied. `rl mem-report` of such
    a run gave no estimate, and a rank (a cluster node without wandb) would refuse the config too.
    The packages and WANDB_MODE are checked on the config that runs."""
    import engine.config.loggers as registry
    from engine.config.load import apply_overrides_to, config_from_dict, load_run_config
    from engine.config.validate import build_run_config
    from engine.errors import ConfigError

    saved = asdict(load_run_config(["trainer.loggers=[console,jsonl,wandb]"]).config)
    monkeypatch.setattr(registry, "missing_module", lambda m: m == "wandb")
    monkeypatch.setenv("WANDB_MODE", "bogus")
    cfg = config_from_dict(saved)
    assert build_run_config(saved, check_environment=False).trainer.loggers == ["console", "jsonl", "wandb"]
    assert apply_overrides_to(cfg, ["trainer.loggers=[console,jsonl]"]).trainer.loggers == ["console", "jsonl"]
    with pytest.raises(ConfigError) as e:
        apply_overrides_to(cfg, [])
    assert "pip install 'rl[tracking]'" in e.value.message
    with pytest.raises(ConfigError):  # an unknown name is still refused wherever the config is read
        config_from_dict(saved | {"trainer": saved["trainer"] | {"loggers": ["console", "wandbb"]}})

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {total_steps: 1, loggers: [console, jsonl, wandb]}\n")
    (run / "memory.jsonl").write_text('{"phase": "update", "step": 1, "rank": 0}\n')
    r = cli("mem-report", str(run), "--json")
    _no_traceback(r)
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["estimate"] is not None, d.get("notes")


def test_a_damaged_tracking_json_starts_new_logger_runs(tmp_path):
    """tracking.json holding a JSON list or string (damaged, edited) made wandb and MLflow fail
    opening (`'list' object has no attribute 'get'`), stopping the run; it is read as no ids."""
    from engine.tracking.state import STATE_FILE, read_state, update_state

    for text in ("[1, 2]", '"x"', "null"):
        (tmp_path / STATE_FILE).write_text(text)
        assert read_state(tmp_path) == {}
        update_state(tmp_path, wandb_run_id="abc")
        assert read_state(tmp_path) == {"wandb_run_id": "abc"}


def test_a_run_without_metrics_jsonl_says_why_only_val_metrics_exist(tmp_path):
    """A run started (or resumed) with trainer.loggers without jsonl keeps only validation.jsonl;
    `rl plot RUN` then said only "no metric `train/reward` ... did you mean `val/reward`", not
    why the step metrics were missing nor how to keep them."""
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "validation.jsonl").write_text('{"step": 0, "accuracy": 0.1, "reward": 0.2}\n')
    r = cli("plot", str(tmp_path))
    _no_traceback(r)
    text = flat(r.stderr)
    assert r.exit_code == 2 and "without jsonl" in text and "Did you mean `val/reward`?" in text, text
    assert _plot_json(str(tmp_path), "--metric", "val/reward")["runs"][0]["steps"] == [0]


def test_integers_beyond_any_float_are_not_drawn(tmp_path):
    """A metrics.jsonl or validation.jsonl value of 10**400 (damaged digits; JSON has no limit)
    was an OverflowError traceback from `rl plot` (math.isfinite on the int). Such a value is not
    a finite number and is not drawn, like NaN."""
    big = "1" + "0" * 400
    (tmp_path / "metrics.jsonl").write_text(
        f'{{"step": 1, "reward_mean": {big}}}\n{{"step": 2, "reward_mean": 0.5, "timing": {{"rollout": {big}}}}}\n')
    (tmp_path / "validation.jsonl").write_text(f'{{"step": 0, "reward": {big}, "accuracy": 0.5}}\n')
    d = _plot_json(str(tmp_path))
    assert d["runs"][0]["steps"] == [2], d
    d = _plot_json(str(tmp_path), "--metric", "val/accuracy")
    assert d["runs"][0]["steps"] == [0], d
    r = cli("plot", str(tmp_path), "--metric", "val/reward")
    _no_traceback(r)
    assert r.exit_code == 2 and "no metric `val/reward`" in flat(r.stderr), r.output


def test_mem_report_integers_beyond_any_float_are_damage_not_a_traceback(tmp_path):
    """memory.jsonl with `rss: 10**400` and metrics.jsonl micro_batch_shapes [[8, 10**400]] were
    OverflowError tracebacks from `rl mem-report RUN` (integer division too large for a float).
    The memory record is named as damaged (its value cut short in the message), exit 2; a shape
    no run can have is skipped like other damaged shapes."""
    big = "1" + "0" * 400
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {total_steps: 1}\n")
    (run / "memory.jsonl").write_text(f'{{"phase": "update", "step": 1, "rank": 0, "rss": {big}}}\n')
    r = cli("mem-report", str(run), "--json")
    _no_traceback(r)
    d = json.loads(r.stdout)
    assert r.exit_code == 2 and "`rss` is 1000" in d["error"]["message"] and big not in d["error"]["message"], d
    (run / "memory.jsonl").write_text('{"phase": "update", "step": 1, "rank": 0}\n')
    (run / "metrics.jsonl").write_text(f'{{"step": 1, "micro_batch_shapes": [[8, {big}]]}}\n')
    r = cli("mem-report", str(run))
    _no_traceback(r)
    assert r.exit_code == 0, r.output


def test_several_runs_are_named_when_the_legend_does_not_fit(tmp_path):
    """plotext drops its legend box, without a word, when it does not fit the chart: 7 runs at
    the default height, or 2 at --height 10 (drawn across the x axis), were unlabelled lines.
    The legend then goes under the chart, each run with its own marker (also without colour,
    where the runs' lines looked alike)."""
    from engine.tracking.series import Series
    from rlcli.render.plot import legend_fits, terminal_chart

    series = [Series(str(tmp_path / f"run{i}"), "train/reward", [1, 2, 3], [0.1 * i, 0.2, 0.3]) for i in range(8)]
    for color in (False, True):
        chart = terminal_chart(series, "train/reward", width=80, height=18, color=color)
        assert all(f"run{i}" in chart for i in range(8)), chart
    assert not legend_fits(8, 18) and legend_fits(2, 18) and not legend_fits(2, 10)
    chart = terminal_chart(series[:2], "train/reward", width=60, height=10, color=False)
    assert "▚ run0   x run1" in chart, chart
    chart = terminal_chart(series[:2], "train/reward", width=60, height=18, color=False)
    assert "run0" in chart and "run1" in chart and "xxx" in chart, chart  # in the box; run1 drawn with x


def test_mlflow_continues_its_run_after_the_run_directory_moved(tmp_path):
    """tracking.json keeps the MLflow URI with the run directory's absolute path: after `mv
    ckpt/ runs/a` each `rl resume` started a new MLflow run in the moved mlflow.db holding only
    the new steps (the old run, with steps 1..2, left behind beside it). And a deleted mlflow.db
    (the id no longer in the store) stopped the run: "The mlflow logger failed ... Run not found".
    The run's own store is asked whether it holds the id."""
    import shutil

    from engine.tracking.base import LoggerContext
    from engine.tracking.mlflow_logger import DB_FILE, MlflowLogger

    def ctx(d, through):
        return LoggerContext(run_dir=d, run_name=d.name, project="rl", config={"a": {"b": 1}},
                             resume_step=None if through < 0 else through, logged_through=through)

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    lg = MlflowLogger(ctx(a, -1))
    first = lg.run_id
    for step in (1, 2):
        lg.log_metrics(step, {"train/reward": step / 10})
    lg.close()
    shutil.move(a, b)
    lg = MlflowLogger(ctx(b, 2))
    assert lg.run_id == first and lg.skip_through == 2
    lg.log_metrics(3, {"train/reward": 0.3})
    lg.close()
    steps = sorted(m.step for m in lg.client.get_metric_history(first, "train/reward"))
    assert steps == [1, 2, 3], steps
    c = tmp_path / "c"  # tracking.json without its mlflow.db (deleted): a store without that run
    c.mkdir()
    shutil.copy(b / "tracking.json", c / "tracking.json")
    assert not (c / DB_FILE).exists()
    lg = MlflowLogger(ctx(c, 3))
    assert lg.run_id != first
    lg.close()


def test_mem_report_estimate_of_a_run_directory_says_to_drop_estimate(tmp_path):
    """`rl mem-report ckpt/ --estimate` said "`ckpt/` is not an override. Overrides look like
    key=value", not that --estimate reports a config and the run is reported without it."""
    r = cli("mem-report", str(tmp_path), "--estimate", "--json")
    _no_traceback(r)
    d = json.loads(r.stdout)
    assert r.exit_code == 2 and "without --estimate" in d["error"]["message"], d
    assert f"rl mem-report {tmp_path}" in d["error"]["message"], d
