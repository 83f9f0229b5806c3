"""`rl train` with a tool: the built-in tool_add task runs multi-turn rollouts end to end (Ray,
gloo, the tiny model), reports the loop's metrics per step and keeps whole conversations in
samples.jsonl; a tool the tokenizer cannot call is refused before anything starts."""

from __future__ import annotations

import json

import pytest

from tests.cli_utils import cli, flat


@pytest.mark.slow
def test_rl_train_with_a_tool_reports_turns_and_keeps_conversations(tmp_path):
    d = tmp_path / "run"
    r = cli("train", "task=tool_add", "trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=4",
            "rollout.max_turns=3", "rollout.max_new_tokens=8", "trainer.sample_log_freq=1", "trainer.val_freq=2",
            f"checkpoint.dir={d}", "--json")
    assert r.exit_code == 0, r.output[-3000:]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        a = row["algo"]
        assert 1 <= a["agent_turns_mean"] <= a["agent_turns_max"] <= 3
        assert a["agent_stop_done"] + a["agent_stop_turn_limit"] + a["agent_stop_token_limit"] == pytest.approx(1)
        assert a["agent_tool_errors"] <= a["agent_tool_calls"]
    samples = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["conversation"][-1]["role"] == "assistant" for s in samples)
    # the response scored is the model's last turn
    assert all(s["response"] == s["conversation"][-1]["content"] for s in samples)
    # rl eval runs the same loop on the checkpoint (rollout.max_turns is read by eval)
    r = cli("eval", str(d), "task=tool_add", "rollout.max_turns=2", "rollout.max_new_tokens=8",
            "eval.max_prompts=4", f"eval.output={tmp_path / 'eval.jsonl'}", "--json")
    assert r.exit_code == 0, r.output[-3000:]
    assert json.loads(r.stdout)["prompts"] == 4


def test_a_tool_call_end_outside_the_vocabulary_is_refused(tmp_path):
    """task=add's character tokenizer has no ']' (the compact format's call end): refused, exit 2."""
    (tmp_path / "mytools.py").write_text('def add(expr: str) -> str:\n    """Adds.\n\n    Args:\n'
                                         '        expr: a+b\n    """\n    return expr\n')
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        r = cli("train", "task=add", "task.tools=[mytools:add]", f"checkpoint.dir={tmp_path / 'run'}")
    finally:
        sys.path.remove(str(tmp_path))
    assert r.exit_code == 2 and "not one token" in flat(r.output)
    assert not (tmp_path / "run").exists()
