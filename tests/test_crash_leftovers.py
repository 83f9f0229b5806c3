"""What a crash leaves in a run directory, and what `rl resume` makes of it.

A row file cut mid-line (what a crash during its append leaves) loses no row: each checkpoint
carries the lines every row file gained since the previous checkpoint
(engine/checkpoint/carried_rows.py). These tests cut the last line of each row file of a real
run at every byte offset and check the repair restores exactly the rows of the uninterrupted
run, once each; then a real `rl resume` after a torn metrics row (the case that lost step 12's
row in issue 47) continues with every step once and the straight run's values.

Leftover directories of interrupted saves and prunes (.tmp-step_N, .stale-step_N-*,
.deleting-step_N) are removed by `rl resume`, which says so, unless something wrote into them
after it took the lock; `rl inspect-ckpt` lists them (engine/checkpoint/leftovers.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from engine.checkpoint.carried_rows import ROW_FILES, ROWS_FILE, repair_row_files
from engine.checkpoint.plan import plan_resume
from engine.checkpoint.leftovers import remove_leftovers
from engine.checkpoint.run_files import row_step
from engine.trainer.run_lock import RunLock
from tests.cli_utils import cli, rl, rl_concurrently

RL_ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}
# 6 steps, a checkpoint every 2, held-out validation every 2 and sample rows every step: every
# row file of a run gets rows between checkpoints
RUN = ["trainer.total_steps=6", "checkpoint.save_freq=2", "checkpoint.keep_last=0", "data.train_batch_size=4",
       "algorithm.rollout_n=2", "trainer.val_freq=2", "trainer.sample_log_freq=1"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("torn") / "run"
    (r,) = rl_concurrently(["train", *RUN, f"checkpoint.dir={run}"], timeout=900, env=RL_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def upto(path: Path, step: int) -> str:
    """The file as it stood when ``step``'s checkpoint was saved: its rows up to ``step``. The
    memory records of the onload a save does (phase "onload" of ``step``) reach memory.jsonl with
    the next step's records, after the checkpoint: a step's own records end with its offload."""
    rows = [ln for ln in lines(path) if row_step(ln) <= step]
    if path.name == "memory.jsonl":
        ends = [i for i, ln in enumerate(rows) if json.loads(ln)["phase"] == "offload" and row_step(ln) == step]
        rows = rows[:ends[-1] + 1]
    return "".join(ln + "\n" for ln in rows)


def stopped_after(src: Path, dst: Path, step: int) -> Path:
    """``src`` as a crash right after saving ``step`` leaves it: later checkpoints and rows gone."""
    shutil.copytree(src, dst)
    for p in dst.glob("step_*"):
        if int(p.name.split("_")[1]) > step:
            shutil.rmtree(p)
    for name in ROW_FILES:
        if (dst / name).exists():
            (dst / name).write_text(upto(src / name, step))
    return dst


@pytest.mark.slow
def test_every_cut_of_each_row_files_last_line_is_repaired(straight, tmp_path, monkeypatch):
    """For the checkpoint of step 4 and each row file, the file cut at every byte offset of its
    last line (the row of step 4, or of step 2 / step 0 for the files that had none at 4) is
    rewritten to exactly what the run wrote up to step 4: the torn row put back from rows.json,
    nothing duplicated, nothing later. The rows are compared with the uninterrupted run's."""
    base = stopped_after(straight, tmp_path / "base", 4)
    carried = json.loads((base / "step_4" / ROWS_FILE).read_text())
    assert carried["after_step"] == 2 and carried["files"]["metrics.jsonl"], carried
    want = {name: upto(straight / name, 4) for name in ROW_FILES}
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # ~3,000 rewrites; durability is not what is tested
    cuts = 0
    for name in ROW_FILES:
        data = want[name].encode()
        assert data, name
        last = data[:-1].rfind(b"\n") + 1  # where the last line starts
        assert row_step(data[last:].decode()) == 4
        for off in range(last, len(data)):  # from the row missing whole to only its newline missing
            (base / name).write_bytes(data[:off])
            restored = repair_row_files(base, base / "step_4", 4)
            for other in ROW_FILES:
                assert (base / other).read_text() == want[other], (name, off, other)
            assert restored == ({} if off == len(data) - 1 else {name: [4]}), (name, off, restored)
            cuts += 1
    assert cuts > 1000  # every byte offset of four last lines


@pytest.mark.slow
def test_rows_after_the_resumed_checkpoint_and_torn_rows_are_dropped(straight, tmp_path):
    """Resuming the earlier checkpoint (step 2) of a run whose metrics end in a torn step-4 row:
    rows 3 and 4 (after the checkpoint) are gone, rows 1-2 stay as written."""
    run = stopped_after(straight, tmp_path / "run", 4)
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[:-40])
    repair_row_files(run, run / "step_2", 2)
    assert (run / "metrics.jsonl").read_text() == upto(straight / "metrics.jsonl", 2)
    assert (run / "validation.jsonl").read_text() == upto(straight / "validation.jsonl", 2)


@pytest.mark.slow
def test_resume_after_a_torn_metrics_row_has_every_step_once(straight, tmp_path):
    """The issue's case, for real: the run stopped after step 4's checkpoint with step 4's
    metrics row cut short (one byte of it, and half of it). The plan says the row is put back;
    `rl resume` ends with rows 1-6 once each, rows 1-4 byte for byte the straight run's and
    5-6 with its values (resume is bit-exact); samples and validation rows likewise once."""
    runs = []
    for keep in ("one byte", "half"):
        run = stopped_after(straight, tmp_path / keep.replace(" ", "_"), 4)
        text = (run / "metrics.jsonl").read_text()
        last = text[:-1].rfind("\n") + 1
        cut = last + 1 if keep == "one byte" else (last + len(text)) // 2
        (run / "metrics.jsonl").write_text(text[:cut])
        plan = plan_resume(run)
        assert plan.step == 4 and plan.rows_restored == {"metrics.jsonl": [4]}, plan.rows_restored
        assert any("put back from step_4/rows.json" in w for w in plan.warnings), plan.warnings
        runs.append(run)
    results = rl_concurrently(*[["resume", str(r)] for r in runs], timeout=900, env=RL_ENV)
    want = lines(straight / "metrics.jsonl")
    for run, r in zip(runs, results):
        assert r.returncode == 0, r.stderr[-3000:]
        got = lines(run / "metrics.jsonl")
        assert [row_step(ln) for ln in got] == [1, 2, 3, 4, 5, 6]
        assert got[:4] == want[:4]
        for g, w in zip(got[4:], want[4:]):
            g, w = json.loads(g), json.loads(w)
            for key in ("reward_mean", "pg_loss", "entropy", "grad_norm", "lr"):
                assert g[key] == w[key], (key, g["step"])
        for name in ("samples.jsonl", "validation.jsonl"):
            steps = [row_step(ln) for ln in lines(run / name)]
            assert steps == [row_step(ln) for ln in lines(straight / name)], name
        resumes = [json.loads(ln) for ln in lines(run / "resumes.jsonl")]
        assert resumes[-1]["rows_restored"] == {"metrics.jsonl": [4]}


def make_leftovers(run: Path, src: Path) -> list[str]:
    """The three kinds, made as the code makes them: a save of step 6 cut short (no manifest), a
    same-named leftover a save moved aside, and a pruned step_2 whose deletion was interrupted."""
    shutil.copytree(src / "step_6", run / ".tmp-step_6")
    (run / ".tmp-step_6" / "manifest.json").unlink()
    shutil.copytree(src / "step_6", run / "step_6")
    (run / "step_6" / "manifest.json").unlink()
    os.replace(run / "step_6", run / ".stale-step_6-1733300000000000000")
    shutil.copytree(src / "step_2", run / ".deleting-step_2")
    return [".deleting-step_2", ".stale-step_6-1733300000000000000", ".tmp-step_6"]


def test_leftovers_written_into_after_the_lock_are_kept(tmp_path):
    """Only a leftover nothing touched since the lock holder started is removed: one another
    process is still writing into (a file in it newer than the lock) is kept."""
    import time

    old, live = tmp_path / ".tmp-step_3", tmp_path / ".deleting-step_1"
    for d in (old, live):
        (d / "state").mkdir(parents=True)
        (d / "state" / "__0_0.distcp").write_bytes(b"x")
        os.utime(d / "state" / "__0_0.distcp", (1, 1))
        os.utime(d / "state", (1, 1))
        os.utime(d, (1, 1))
    started = time.time()
    (live / "state" / "__0_0.distcp").write_bytes(b"more")  # a live writer, after the lock was taken
    (tmp_path / "step_1").mkdir()  # a checkpoint is never a leftover
    removed, kept = remove_leftovers(tmp_path, older_than=started)
    assert removed == [".tmp-step_3"] and kept == [".deleting-step_1"]
    assert live.is_dir() and not old.exists() and (tmp_path / "step_1").is_dir()


@pytest.mark.slow
def test_resume_removes_leftovers_and_says_so_inspect_lists_them(straight, tmp_path):
    """Each kind of leftover is listed by `rl inspect-ckpt` (table and --json); `rl resume`
    refuses while another process holds the run's lock and leaves them; then a resume that
    holds the lock removes them, says so, and finishes the run."""
    run = stopped_after(straight, tmp_path / "run", 4)
    names = make_leftovers(run, straight)
    r = cli("inspect-ckpt", str(run), "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["info"]["leftovers"] == names
    assert all(s["reason"].startswith("leftover") for s in rep["steps"] if s["name"] in names)
    r = cli("inspect-ckpt", str(run))
    assert "3 leftover(s) of interrupted saves or prunes" in " ".join(r.output.split())

    with RunLock(run, command="a live writer"):
        held = rl("resume", str(run), env=RL_ENV, timeout=300)
    assert held.returncode == 2 and "in use by another rl run" in held.stderr, held.stderr[-2000:]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == names

    r = rl("resume", str(run), env=RL_ENV, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = " ".join((r.stdout + r.stderr).split())
    assert "removed 3 leftover(s) of interrupted saves or prunes" in out and all(n in out for n in names), out[-3000:]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]
    assert [row_step(ln) for ln in lines(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_without_rows_json_resumes_as_before_and_a_damaged_one_is_refused(tmp_path):
    """A checkpoint written before rows.json existed: torn rows and rows after its step dropped,
    nothing invented. A rows.json that is not rl's record is a corrupt checkpoint, not a guess."""
    from engine.checkpoint.carried_rows import read_carried
    from engine.errors import CheckpointError

    step_dir = tmp_path / "step_2"
    step_dir.mkdir()
    rows = [json.dumps({"step": s, "x": s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n" + rows[2][:7])
    assert repair_row_files(tmp_path, step_dir, 2) == {}
    assert lines(tmp_path / "metrics.jsonl") == rows[:2]
    for bad in ("[1, 2]", '{"after_step": 1, "files": {"metrics.jsonl": [1]}}', '{"files": {}}'):
        (step_dir / ROWS_FILE).write_text(bad)
        with pytest.raises(CheckpointError, match="not a rows record"):
            read_carried(step_dir)
