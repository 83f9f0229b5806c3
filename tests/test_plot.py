"""`rl plot`: one or several runs from their metrics files, in the terminal (plotext), as a PNG
(matplotlib) and as JSON series; right number of points per run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tracking.jsonl_logger import JsonlLogger
from engine.events import StepRecord, Validation


def rl(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "rlcli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def make_run(root: Path, steps: list[int], val_steps: list[int] = (), sample_versions: dict | None = None,
             step_times: dict | None = None) -> Path:
    """A run directory written by the trainer's own writers (metrics.jsonl, validation.jsonl).
    ``sample_versions``: step -> the policy versions of its batch's samples (a run that samples
    ahead; the row's ``staleness`` as the trainer writes it); ``step_times``: step -> step_time_s."""
    from engine.algorithms.staleness import staleness_record

    root.mkdir(parents=True)
    (root / "run.json").write_text("{}")
    log = JsonlLogger(root)
    for s in steps:
        rec = StepRecord(step=s, reward_mean=s / 100, accuracy=None, kl=None, pg_loss=0.0, entropy=None,
                         grad_norm=1.0, lr=1e-3, response_len_mean=4.0, rollout_tokens_per_s=1.0,
                         update_tokens_per_s=1.0, step_time_s=(step_times or {}).get(s, 0.1 * s), peak_mem_bytes=1,
                         pad_fraction=0.0, distinct_shapes=1, timing={"rollout": 0.05})
        if sample_versions and s in sample_versions:
            rec.staleness = staleness_record(sample_versions[s], s)
        log.write_step(rec.to_json())
    with open(root / "validation.jsonl", "a") as f:
        for s in val_steps:
            f.write(json.dumps(Validation(s, s / 10, s / 20).to_json()) + "\n")
    return root


@pytest.fixture
def runs(tmp_path):
    a = make_run(tmp_path / "a" / "ckpt", list(range(1, 6)), [0, 5])
    b = make_run(tmp_path / "b" / "ckpt", list(range(1, 9)))
    return a, b


def test_json_series_have_one_point_per_step_per_run(runs):
    a, b = runs
    r = rl("plot", str(a), str(b), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["metric"] == "train/reward"
    assert [x["points"] for x in out["runs"]] == [5, 8]
    assert out["runs"][1]["steps"] == list(range(1, 9))
    assert out["runs"][0]["values"] == pytest.approx([s / 100 for s in range(1, 6)])


def test_validation_and_perf_metrics_and_aliases(runs):
    a, _ = runs
    r = rl("plot", str(a), "--metric", "val/accuracy", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["runs"][0]
    assert s["steps"] == [0, 5] and s["values"] == pytest.approx([0.0, 0.5])
    r = rl("plot", str(a / "metrics.jsonl"), "--metric", "perf/time/rollout", "--json")
    assert json.loads(r.stdout)["runs"][0]["points"] == 5
    r = rl("plot", str(a), "--metric", "reward_mean", "--json")  # a metrics.jsonl field name works too
    assert json.loads(r.stdout)["metric"] == "train/reward"


def test_a_step_logged_twice_counts_once_with_its_last_value(tmp_path):
    """Rows of an abandoned segment (a run killed after its checkpoint, then resumed) must not
    draw a step twice: the last row of a step wins."""
    run = make_run(tmp_path / "run", [1, 2, 3])
    JsonlLogger(run).write_step({"step": 2, "reward_mean": 0.9})
    from engine.tracking.series import load_series

    s = load_series(run, "train/reward")
    assert s.steps == [1, 2, 3] and s.values[1] == 0.9


def test_png_has_one_line_per_run_with_its_points(runs, tmp_path):
    a, b = runs
    out = tmp_path / "plots" / "reward.png"
    r = rl("plot", str(a), str(b), "--png", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["png"] == str(out)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.image

    img = matplotlib.image.imread(out)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert not list(out.parent.glob(".*"))  # no temp file left behind

    from engine.tracking.series import load_series
    from rlcli.render.plot import png_figure

    fig = png_figure([load_series(a, "train/reward"), load_series(b, "train/reward")], "train/reward")
    lines = fig.axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines] == [5, 8]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["a/ckpt", "b/ckpt"]


def test_terminal_chart_names_the_runs_and_has_no_ansi_on_a_pipe(runs):
    a, b = runs
    r = rl("plot", str(a), str(b), "--width", "70", "--height", "14")
    assert r.returncode == 0, r.stderr
    assert not re.search(r"\x1b\[", r.stdout)
    assert "train/reward" in r.stdout and "a/ckpt" in r.stdout and "b/ckpt" in r.stdout
    assert len(r.stdout.splitlines()) >= 14


def test_terminal_chart_draws_every_point():
    """plotext's chart of a series spans its first and last step on the x axis."""
    from engine.tracking.series import Series
    from rlcli.render.plot import terminal_chart

    text = terminal_chart([Series("r", "train/reward", [10, 20, 30], [0.1, 0.5, 0.2])], "train/reward",
                          width=60, height=12, color=False)
    assert "\x1b[" not in text and "train/reward" in text
    assert "10" in text.splitlines()[-2] and "30" in text.splitlines()[-2]


def test_unknown_metric_and_missing_run_are_user_errors(runs, tmp_path):
    a, _ = runs
    r = rl("plot", str(a), "--metric", "train/rewrd")
    assert r.returncode == 2 and "train/reward" in r.stderr and "Traceback" not in r.stderr
    r = rl("plot", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in flat(r.stderr)
    r = rl("plot", str(a), "--list", "--json")
    assert "train/grad_norm" in json.loads(r.stdout)["metrics"][str(a)]
    # a width the chart cannot be drawn in: refused (it printed an empty frame, exit 0); 20 draws a chart
    r = rl("plot", str(a), "--width", "3")
    assert r.returncode == 2 and "--width 3 is too narrow" in flat(r.stderr) and "--width 20" in flat(r.stderr), r
    assert r.stdout == "" and "Traceback" not in r.stderr
    r = rl("plot", str(a), "--width", "20", "--height", "8")
    assert r.returncode == 0 and "train/reward" in r.stdout and "┤" in r.stdout, r.stderr


@pytest.mark.parametrize("target", ["metrics", "config", "fifo", "device", "directory", "proc"])
def test_png_never_replaces_a_file_that_is_not_a_png(runs, tmp_path, target):
    """--png over the run's own metrics.jsonl (or any file that is not a PNG) replaced it with the
    chart, and --png /dev/null replaced the device node with a regular file: an existing target
    must be an earlier PNG; a FIFO, a device, a directory or an unwritable place (/proc) is
    refused before anything is read, exit 2, stdout empty under --json, nothing changed."""
    import os
    import stat

    from tests.cli_utils import cli
    from tests.ckpt_tools import tree_state

    a, _ = runs
    (tmp_path / "config.yaml").write_text("model: x\n")
    special = tmp_path / "special"
    if target == "fifo":
        os.mkfifo(special)
    elif target == "device":
        try:
            os.mknod(special, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
        except PermissionError:
            pytest.skip("making a device node needs root with CAP_MKNOD")
    out, needle = {"metrics": (a / "metrics.jsonl", "is not a PNG image"),
                   "config": (tmp_path / "config.yaml", "is not a PNG image"),
                   "fifo": (special, "is a FIFO"), "device": (special, "is a device"),
                   "directory": (a, "is a directory"), "proc": (Path("/proc/rl-plot-test.png"), "cannot be created")
                   }[target]
    before = tree_state(tmp_path)
    r = cli("plot", str(a), "--png", str(out), "--json")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert json.loads(r.stdout)["error"]["exit_code"] == 2, r.stdout  # --json: the error as JSON on stdout
    assert needle in flat(r.stderr), r.stderr
    assert tree_state(tmp_path) == before


def test_png_replaces_an_earlier_png_with_ordinary_permissions(runs, tmp_path):
    """Rewriting the same chart works, and the file gets the umask's permissions, not mkstemp's 0600."""
    import os

    from tests.cli_utils import cli

    a, _ = runs
    out = tmp_path / "reward.png"
    for _ in range(2):
        r = cli("plot", str(a), "--png", str(out), "--json")
        assert r.exit_code == 0, r.output
    mask = os.umask(0)
    os.umask(mask)
    assert out.read_bytes()[:4] == b"\x89PNG" and (out.stat().st_mode & 0o777) == (0o666 & ~mask)


@pytest.mark.parametrize("damage", ["garbage", "directory", "fifo", "device", "list_rows"])
def test_damaged_metrics_file_is_a_clean_error_or_skipped(runs, damage):
    """metrics.jsonl of binary garbage (UnicodeDecodeError) or a directory there (IsADirectoryError)
    were tracebacks, and a FIFO or a link to /dev/zero hung `rl plot` forever: they are refused
    unread or (damaged lines) skipped; exit 2 with the error as JSON on stdout under --json, well within 5 s."""
    import os
    import time

    from tests.cli_utils import cli

    a, _ = runs
    m = a / "metrics.jsonl"
    (a / "validation.jsonl").unlink()
    good = m.read_text()
    m.unlink()
    if damage == "garbage":
        m.write_bytes(b"\x94\xea\xff\x00 not json\n" * 20)
    elif damage == "directory":
        m.mkdir()
    elif damage == "fifo":
        os.mkfifo(m)
    elif damage == "device":
        m.symlink_to("/dev/zero")
    else:  # rows that are JSON but not objects, around the good ones: those still plot
        m.write_text('[1, 2]\n"x"\n{"step": true}\n' + good + "\xff\n")
    t0 = time.monotonic()
    r = cli("plot", str(a), "--json")
    assert time.monotonic() - t0 < 5 and "Traceback" not in r.output
    if damage == "list_rows":
        assert r.exit_code == 0 and json.loads(r.stdout)["runs"][0]["points"] == 5, r.output
        return
    needle = {"garbage": "damaged", "directory": "is a directory", "fifo": "is a FIFO", "device": "is a device"}
    assert r.exit_code == 2 and needle[damage] in flat(r.stderr), r.output
    assert needle[damage] in json.loads(r.stdout)["error"]["message"], r.stdout  # --json: the error on stdout


@pytest.mark.parametrize("kind", ["file", "fifo", "device"])
def test_a_run_path_that_is_not_a_directory_is_named(tmp_path, kind):
    """`rl plot FILE` said "no rows in FILE/metrics.jsonl"; a FIFO or a device is named as one."""
    import os

    from tests.cli_utils import cli

    p = tmp_path / "thing"
    if kind == "file":
        p.write_text("x")
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        p = Path("/dev/zero")
    r = cli("plot", str(p))
    assert r.exit_code == 2 and "not a run directory" in flat(r.stderr) and "Traceback" not in r.output, r.output


def test_x_version_puts_each_batch_at_the_policy_that_sampled_it(tmp_path):
    """--x version: a synchronous run's step k was sampled by the weights after k - 1 updates; a
    run that samples ahead records its batch's versions (one_step_off: k - 2 from step 2 on; async:
    a mixed batch at its mean version); a validation after step s reads version s."""
    sync = make_run(tmp_path / "sync", [1, 2, 3, 4], [0, 4])
    ahead = make_run(tmp_path / "ahead", [1, 2, 3, 4], [0, 4],
                     sample_versions={1: [0] * 4, 2: [0] * 4, 3: [1, 1, 0, 0], 4: [2] * 4})
    r = rl("plot", str(sync), str(ahead), "--x", "version", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["x_axis"] == "version"
    assert [x["x"] for x in out["runs"]] == [[0, 1, 2, 3], [0, 0, 0.5, 2]]
    assert [x["steps"] for x in out["runs"]] == [[1, 2, 3, 4]] * 2  # the steps are kept beside
    r = rl("plot", str(ahead), "--metric", "val/reward", "--x", "version", "--json")
    assert json.loads(r.stdout)["runs"][0]["x"] == [0, 4]
    r = rl("plot", str(sync), str(ahead), "--x", "version", "--width", "70", "--height", "14")
    assert r.returncode == 0 and "policy version that sampled the batch" in r.stdout, r.stderr


def test_x_time_is_the_training_time_through_each_step(tmp_path):
    """--x time: the sum of step_time_s over the steps up to the point's (validation at step 0 at
    time 0; a step logged twice counts once, with its last row's time)."""
    run = make_run(tmp_path / "run", [1, 2, 3], [0, 3], step_times={1: 2.0, 2: 0.5, 3: 0.25})
    JsonlLogger(run).write_step({"step": 2, "reward_mean": 0.9, "step_time_s": 1.5})  # resumed: step 2 again
    r = rl("plot", str(run), "--x", "time", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["runs"][0]["x"] == pytest.approx([2.0, 3.5, 3.75])
    r = rl("plot", str(run), "--metric", "val/accuracy", "--x", "time", "--json")
    assert json.loads(r.stdout)["runs"][0]["x"] == pytest.approx([0.0, 3.75])


def test_an_unknown_axis_or_a_run_without_step_times_is_a_user_error(tmp_path):
    run = make_run(tmp_path / "run", [1, 2])
    r = rl("plot", str(run), "--x", "steps")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Unknown x axis `steps`. Use one of: step, version, time." in flat(r.stdout + r.stderr)
    bare = tmp_path / "bare"
    bare.mkdir()
    JsonlLogger(bare).write_step({"step": 1, "reward_mean": 0.5})
    r = rl("plot", str(bare), "--x", "time")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "records no step times" in flat(r.stdout + r.stderr)
    assert rl("plot", str(bare), "--x", "version", "--json").returncode == 0  # no staleness: version = step - 1
