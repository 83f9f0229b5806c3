"""`rl train` end to end through the real CLI, Ray, gloo and DCP."""

from __future__ import annotations

import json

import pytest

from tests.cli_utils import rl_concurrently, rl as run_rl


def rl(*args, cwd=None, timeout=600):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, cwd=cwd, timeout=timeout)


@pytest.mark.slow
def test_rl_train_few_steps_writes_run_dir_and_checkpoint(tmp_path):
    """A short run prints the plan, step rows and summary, writes config/metrics/memory and
    a complete checkpoint, and a second `rl train` into the same dir refuses (exit 2)."""
    d = tmp_path / "ckpt"
    r = rl("train", "trainer.total_steps=3", "checkpoint.save_freq=2", f"checkpoint.dir={d}",
           "data.train_batch_size=8", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["steps_run"] == 3 and summary["last_step"] == 3
    assert "reward" in r.stderr and "summary" in r.stderr
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert (d / "memory.jsonl").stat().st_size > 0
    assert (d / "step_2" / "manifest.json").exists() and (d / "step_3" / "manifest.json").exists()
    manifest = json.loads((d / "step_3" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert all(manifest["optimizer"]["param_state"].values())
    again = rl("train", "trainer.total_steps=3", f"checkpoint.dir={d}")
    assert again.returncode == 2 and "rl resume" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.slow
def test_rl_train_two_ranks_learns(tmp_path):
    """trainer.nprocs=2 runs the default job over two gloo ranks and learns (reward of the
    last 10 steps at least double the first 10)."""
    d = tmp_path / "ckpt"
    r = rl("train", "trainer.nprocs=2", "trainer.total_steps=30", f"checkpoint.dir={d}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["reward_last10"] >= 2 * s["reward_first10"], s
    manifest = json.loads((d / "step_30" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["parallel"]["dp"] == 2


@pytest.mark.slow
def test_rl_train_prompt_file_with_user_reward(tmp_path):
    """task=jsonl with task.reward_fn=module:function imported from the current directory
    (as TRL users expect), on the tiny model with the built-in character tokenizer. The run
    directory is relative (`ck`): on the session's joined Ray head (tests/conftest.py) the ranks
    work in another directory, so it must reach them absolute."""
    rows = [{"prompt": f"say {w}:", "answer": w} for w in ["hi", "ok", "yes", "no"] * 8]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "myrewards.py").write_text(
        "def starts_right(prompt, response, answer):\n"
        "    return float(response[:1] == answer[:1])\n")
    r, bad = rl_concurrently(["train", "task=jsonl", "task.path=prompts.jsonl", "task.reward_fn=myrewards:starts_right",
                              "trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=2",
                              "checkpoint.dir=ck", "--json"],
                             ["train", "task=jsonl", "task.path=prompts.jsonl", "task.reward_fn=myrewards:nope",
                              "checkpoint.dir=ck2"], cwd=tmp_path)  # independent runs, at once
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["steps_run"] == 2
    assert bad.returncode == 2 and "no function `nope`" in bad.stderr
