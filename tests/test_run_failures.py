"""What runs leave behind when they fail, and what they save (issue 19, findings 6 and 8):
a run that fails before its first row leaves nothing that blocks a retry; a full or read-only
disk during a run stops it with exit 2 naming the intact last checkpoint; `--json` is standard
JSON; overwrite clears every file of the old run; secrets from the environment are never saved."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli_utils import flat, rl

pytestmark = pytest.mark.slow
SMALL = ["data.train_batch_size=4", "algorithm.rollout_n=4"]


def _strict_json(text: str):
    def refuse(c):
        raise AssertionError(f"non-standard JSON constant {c}")

    return json.loads(text, parse_constant=refuse)


def _steps(d: Path, name: str = "metrics.jsonl") -> list[int]:
    p = d / name
    return [json.loads(x)["step"] for x in p.read_text().splitlines()] if p.exists() else []


def test_failed_reward_leaves_nothing_then_zero_reward_json_then_overwrite_clears_everything(tmp_path):
    rows = [{"prompt": f"say {w}:", "answer": w} for w in ["hi", "ok", "yes", "no"] * 4]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "rl_test_rewards.py").write_text(
        "def broken(prompt, response, answer):\n    raise ValueError('reward bug')\n\n"
        "def zero(prompt, response, answer):\n    return 0.0\n\n"
        "def first_char(prompt, response, answer):\n    return float(response[:1] == answer[:1])\n")
    d = tmp_path / "run"
    task = ["task=jsonl", "task.path=prompts.jsonl", "data.max_prompt_length=32", f"checkpoint.dir={d}", *SMALL]

    # 1. the reward function raises at step 1: the run fails and removes what it created
    r = rl("train", *task, "task.reward_fn=rl_test_rewards:broken", "trainer.total_steps=2", cwd=tmp_path)
    assert r.returncode != 0 and "reward bug" in r.stderr, r.stderr[-3000:]
    assert not d.exists(), sorted(p.name for p in d.iterdir())

    # 2. the retry in the same checkpoint.dir is not blocked; a first reward of 0 gives no Infinity
    r = rl("train", *task, "task.reward_fn=rl_test_rewards:zero", "trainer.total_steps=2",
           "trainer.val_freq=1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = _strict_json(r.stdout)
    assert summary["reward_first10"] == 0.0 and summary["improvement"] is None
    assert (d / "validation.jsonl").exists() and (d / "step_2" / "manifest.json").exists()
    (d / "resumes.jsonl").write_text('{"step": 2}\n')

    # 3. checkpoint.overwrite=true: every file of the old run goes, not only its checkpoints
    r = rl("train", *task, "task.reward_fn=rl_test_rewards:first_char", "trainer.total_steps=1",
           "checkpoint.overwrite=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(d) == [1]
    assert {x["step"] for x in map(json.loads, (d / "memory.jsonl").read_text().splitlines())} == {1}
    assert not (d / "validation.jsonl").exists() and not (d / "resumes.jsonl").exists()
    assert not (d / "step_2").exists() and (d / "step_1" / "manifest.json").exists()


def test_environment_values_are_saved_as_interpolations_and_resolved_again_on_resume(tmp_path):
    secret = "tok-9f8e7d6c5b4a"
    d = tmp_path / "run"
    env = {"RL_TEST_SECRET": secret, "RL_TEST_SECRET_2": secret + "-2"}
    r = rl("train", "trainer.total_steps=1", f"checkpoint.dir={d}", "trainer.project=${oc.env:RL_TEST_SECRET}",
           *SMALL, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    # a resume override that reads the environment: recorded (resumes.jsonl, the plan) as its text
    r = rl("resume", str(d), "trainer.total_steps=2", "trainer.project=${oc.env:RL_TEST_SECRET_2}", cwd=tmp_path,
           env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert secret not in r.stdout + r.stderr
    changes = json.loads((d / "resumes.jsonl").read_text().splitlines()[-1])["config_changes"]
    project = next(c for c in changes if c["key"] == "trainer.project")
    assert (project["then"], project["now"], project["allowed"]) == \
        ("${oc.env:RL_TEST_SECRET}", "${oc.env:RL_TEST_SECRET_2}", True)
    leaked = [str(p) for p in d.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == []
    assert "${oc.env:RL_TEST_SECRET}" in (d / "config.yaml").read_text()
    for step, var in (("step_1", "RL_TEST_SECRET"), ("step_2", "RL_TEST_SECRET_2")):
        m = json.loads((d / step / "manifest.json").read_text())
        assert m["config"]["trainer"]["project"] == "${oc.env:" + var + "}"
    # resuming without the variable: a clear refusal naming it
    r = rl("resume", str(d), "trainer.total_steps=3", "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "RL_TEST_SECRET" in flat(r.stderr) and secret not in r.stderr + r.stdout


def _mount(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.decode().strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _assert_stopped_cleanly(r, d: Path, reason: str, writable: bool = True) -> int:
    """Exit 2 naming the reason and the last complete checkpoint, which is intact; returns its step."""
    text = flat(r.stderr)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and reason in text, text
    done = sorted(int(p.name.split("_")[1]) for p in d.glob("step_*") if (p / "manifest.json").is_file())
    assert done, "no complete checkpoint survived"
    nospace = "".join(text.split())  # rich folds long paths across lines
    assert "".join(f"{d}/step_{done[-1]}(step{done[-1]}),intact".split()) in nospace, text  # d may hold a space
    if writable:  # the unfinished save is removed (a read-only file system keeps it; resume ignores it)
        assert not list(d.glob(".tmp-step_*")) and not list(d.glob("*.tmp")), sorted(p.name for p in d.iterdir())
    return done[-1]


def test_disk_full_during_a_run_stops_cleanly_and_the_run_resumes(tmp_path):
    """A tmpfs with room for one checkpoint but not two: the second save fails (ENOSPC on the
    rank writing DCP shards). Exit 2 naming step_1 as intact; after making room, `rl resume`
    continues from it with one metrics row per step."""
    mnt = tmp_path / "small"
    _mount(mnt, "2600k")
    try:
        d = mnt / "run"
        r = rl("train", "trainer.total_steps=3", "checkpoint.save_freq=1", f"checkpoint.dir={d}", *SMALL,
               cwd=tmp_path)
        last = _assert_stopped_cleanly(r, d, "the disk is full")
        assert last == 1
        subprocess.run(["mount", "-o", "remount,size=20m", str(mnt)], check=True)
        r = rl("resume", str(d), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _steps(d) == [1, 2, 3]
    finally:
        _umount(mnt)


def test_read_only_file_system_during_a_run_stops_cleanly(tmp_path):
    """The file system turns read-only once step_1 is saved (observed, then `mount -o remount,ro`):
    exit 2 naming the last complete checkpoint, intact."""
    mnt = tmp_path / "fs"
    _mount(mnt, "64m")
    try:
        d = mnt / "run"
        import os
        import sys

        from tests.cli_utils import ROOT

        p = subprocess.Popen([sys.executable, "-m", "rlcli.main", "train", "trainer.total_steps=5",
                              "checkpoint.save_freq=1", f"checkpoint.dir={d}", *SMALL], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 600  # a hang guard, not a timing assertion
        while not (d / "step_1" / "manifest.json").exists() and p.poll() is None:
            assert time.monotonic() < deadline, "step_1 never appeared"
            time.sleep(0.05)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        out, err = p.communicate(timeout=600)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        _assert_stopped_cleanly(r, d, "read-only", writable=False)
    finally:
        _umount(mnt)


def test_sigterm_landing_while_an_oserror_is_handled_stays_a_stop_not_a_write_failure(tmp_path):
    """A SIGTERM just after a save renamed .tmp-step_N into place can land while the main thread
    handles that path's FileNotFoundError (a `.exists()` of the renamed directory): SystemExit(143)
    then carries the OSError as its __context__. The run guard must let the stop through (exit 143,
    as Ctrl-C), not report "run stopped: write failed" (exit 2), which CI once saw."""
    from engine.config.load import load_run_config
    from engine.sigterm import TERMINATED_EXIT
    from engine.trainer.run_guard import guarded_run

    run = tmp_path / "run"
    cfg = load_run_config(["trainer.total_steps=1", f"checkpoint.dir={run}"]).config
    with pytest.raises(SystemExit) as e:
        with guarded_run(cfg, run, overrides=[], resume=None, env_refs=None, on_event=lambda _: None):
            try:
                (run / ".tmp-step_1" / "x").stat()
            except FileNotFoundError:
                raise SystemExit(TERMINATED_EXIT)  # what engine/sigterm.py's handler raises
    assert e.value.code == TERMINATED_EXIT
    assert isinstance(e.value.__context__, FileNotFoundError)
