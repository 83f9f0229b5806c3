"""Tool calls run where reward functions run (engine/agents/tool_calls.py): with
task.reward_workers>=1 in the reward process pool, every call of a turn at once, each bounded by
task.reward_timeout_s. A call that hangs or kills its worker is the model's problem, never the
run's: its error goes back to the model as the tool's message and is counted (timeouts also on
their own), and the pool carries on with a fresh worker. An environment of the user's that raises
stops the run with a one-paragraph error naming it."""

from __future__ import annotations

import json

import pytest

from engine.agents.environment import ToolEnvironment
from engine.agents.parsers import HermesParser
from engine.agents.tool_calls import ToolRunner
from engine.errors import ConfigError
from engine.rewards.compute import RewardRunner
from tests import agent_pool_tools as T
from tests.cli_utils import cli, flat

TOOLS = {"slow": T.slow, "die": T.die, "meet": T.meet, "add": T.add}


def _turn(*calls) -> list[dict]:
    text = "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls)
    return [{"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def pool():
    runner = RewardRunner([], workers=2, timeout_s=3.0)
    yield runner
    runner.close()


def _step(env, run, messages):
    pending = env.begin(messages)
    return pending.finish(run(pending.calls))


def test_a_hung_call_and_a_crashed_worker_go_back_to_the_model_counted(pool):
    env, run = ToolEnvironment(TOOLS, HermesParser()), ToolRunner(pool, TOOLS)
    step = _step(env, run, _turn(("slow", {"seconds": "30"}), ("die", {"code": "3"}), ("add", {"expr": "2+3"})))
    slow, die, add = [m["content"] for m in step.messages]
    assert slow == "error: the tool gave no result within 3 s"
    assert die.startswith("error:") and "process died" in die and "exit code 3" in die
    assert add == "5"
    assert (step.tool_calls, step.tool_errors, step.tool_timeouts, step.done) == (3, 2, 1, False)
    # the pool replaced both workers: the next turn's calls run
    again = _step(env, run, _turn(("add", {"expr": "3+4"}), ("add", {"expr": "10+1"})))
    assert [m["content"] for m in again.messages] == ["7", "11"] and again.tool_errors == 0


def test_every_trajectorys_calls_of_a_turn_run_at_once(pool, tmp_path):
    """Two trajectories' calls that each wait for the other: both meet only if they run together."""
    envs = [ToolEnvironment(TOOLS, HermesParser()) for _ in range(2)]
    pendings = [envs[0].begin(_turn(("meet", {"spec": f"{tmp_path}|a|b"}))),
                envs[1].begin(_turn(("meet", {"spec": f"{tmp_path}|b|a"})))]
    results = ToolRunner(pool, TOOLS)([c for p in pendings for c in p.calls])
    assert [r.content for r in results] == ["met", "met"]


def test_the_pool_answers_what_the_driver_answers(pool):
    calls = _turn(("add", {"expr": "1+2"}), ("add", {"expr": "x+1"}), ("nope", {}), ("add", {"expr": "40+2"}))
    in_pool = _step(ToolEnvironment(TOOLS, HermesParser()), ToolRunner(pool, TOOLS), calls)
    inline = _step(ToolEnvironment(TOOLS, HermesParser()), ToolRunner(), calls)
    assert in_pool.messages == inline.messages
    assert (in_pool.tool_calls, in_pool.tool_errors) == (inline.tool_calls, inline.tool_errors) == (4, 2)
    assert "no tool named 'nope'" in in_pool.messages[2]["content"]


def test_a_tool_the_pool_cannot_import_is_refused_at_setup():
    runner = RewardRunner([], workers=1)
    try:
        with pytest.raises(ConfigError, match="task.reward_workers=0"):
            ToolRunner(runner, {"local": lambda expr: expr})
    finally:
        runner.close()


BROKEN_ENV = '''
from engine.agents.environment import Environment, EnvStep

class Broken(Environment):
    def step(self, messages):
        raise KeyError("board")
'''


@pytest.mark.slow
def test_an_environment_that_raises_stops_the_run_naming_it(tmp_path, monkeypatch):
    (tmp_path / "brokenenv.py").write_text(BROKEN_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = cli("train", "task=tool_add", "task.environment=brokenenv:Broken", "trainer.total_steps=2",
            "data.train_batch_size=2", "algorithm.rollout_n=2", f"checkpoint.dir={tmp_path / 'run'}")
    out = flat(r.output)
    assert r.exit_code == 2, out[-2000:]
    assert "brokenenv:Broken raised in step(messages): KeyError: 'board'" in out and "Traceback" not in out
