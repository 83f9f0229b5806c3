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


def test_reward_on_error_raise_does_not_stop_the_run_for_a_tools_error():
    """task.reward_on_error=raise (the default) is about scoring: a tool's timeout still goes back
    to the model. Here with reward_workers=0: on the driver, watched with the timeout."""
    runner = RewardRunner([], workers=0, timeout_s=0.5, on_error="raise")
    env, run = ToolEnvironment(TOOLS, HermesParser()), ToolRunner(runner, TOOLS)
    step = _step(env, run, _turn(("slow", {"seconds": "3"}), ("add", {"expr": "1+1"})))
    assert [m["content"] for m in step.messages] == ["error: the tool gave no result within 0.5 s", "2"]
    assert (step.tool_errors, step.tool_timeouts) == (1, 1)


def _rows(d) -> list[dict]:
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # what the clock decides
        for k in [k for k in r if k.endswith(("_per_s", "_bytes", "_s")) or k in ("timing", "mem_peaks")]:
            r.pop(k)
        r["checkpoint"] = r["checkpoint"] and r["checkpoint"].rsplit("/", 1)[-1]  # the run's own directory
    return rows


@pytest.mark.slow
def test_a_run_gives_the_same_rows_with_tools_in_the_pool_and_on_the_driver(tmp_path):
    runs = {}
    for w in (0, 2):
        d = tmp_path / f"w{w}"
        r = cli("train", "task=tool_add", "rollout.max_turns=2", "rollout.max_new_tokens=9", "trainer.total_steps=3",
                "data.train_batch_size=4", "algorithm.rollout_n=4", f"task.reward_workers={w}",
                f"checkpoint.dir={d}", "--json")
        assert r.exit_code == 0, r.output[-3000:]
        runs[w] = _rows(d)
    assert len(runs[0]) == 3
    for a, b in zip(runs[0], runs[2]):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert sum(r["algo"]["agent_tool_calls"] for r in runs[0]) > 0  # tools were called


def test_a_run_sends_its_tool_calls_to_the_reward_pool():
    """The run's inputs (what `rl train` builds) hand the tool loop the run's reward executors: with
    task.reward_workers=1, task=tool_add's calculator answers from a worker process."""
    import os

    from engine.config.load import load_run_config
    from engine.trainer.setup import prepare_inputs

    inputs = prepare_inputs(load_run_config(["task=tool_add", "rollout.max_turns=2", "task.reward_workers=1"]).config)
    try:
        run = inputs.agent.run_tools
        assert run.rewards is inputs.rewards and inputs.rewards.workers == 1
        calls = [(os.getpid, type("Call", (), {"arguments": {}})())]
        assert run(calls)[0].content != str(os.getpid())  # ran in another process
        calc = next(iter(inputs.agent.tools.values()))
        env = inputs.agent.make_env()
        env.reset(type("Row", (), {"prompt": "12+30%7="})())
        pending = env.begin([{"role": "assistant", "content": "[12+30]"}])
        assert [r.content for r in run(pending.calls)] == [calc("12+30")]
    finally:
        inputs.rewards.close()


def test_an_environment_that_needs_the_main_thread_is_told_why_off_it():
    """In the modes that sample ahead, episodes run on a driver thread, where signal.alarm-style
    timeouts cannot be set: the error says so and names the fix; on the main thread it runs."""
    import signal
    import threading

    from engine.agents.environment import Environment
    from engine.agents.loop import _env_call
    from engine.errors import EnvironmentFailed

    class Alarmed(Environment):
        def reset(self, row):
            signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))  # as a timeout would
            return None

        def step(self, messages):
            raise AssertionError("not reached")

    assert _env_call(Alarmed(), "reset", None) is None  # main thread: fine
    caught = []

    def off_main():
        try:
            _env_call(Alarmed(), "reset", None)
        except EnvironmentFailed as e:
            caught.append(str(e))

    t = threading.Thread(target=off_main, name="rl-episodes_0")
    t.start()
    t.join()
    assert caught and "raised in reset(row): ValueError: signal only works in main thread" in caught[0]
    assert "driver thread `rl-episodes_0` (trainer.mode=one_step_off|async runs the agent loop" in caught[0], caught
    assert "trainer.mode=sync" in caught[0]


def test_a_tool_that_needs_the_main_thread_stops_the_run_off_it_with_the_fix(pool):
    """A tool with a signal.alarm timeout answers on the main thread and in the pool, but off the
    main thread (one_step_off's agent loop on `rl-episodes`, or reward_timeout_s's watched thread)
    every call fails whatever the model wrote: the run stops with the tool, the thread and the fix
    (reward_workers>=1) instead of handing the model the error as the tool's answer."""
    from concurrent.futures import ThreadPoolExecutor

    tools = {"alarmed": T.alarmed}
    env = ToolEnvironment(tools, HermesParser())
    turn = _turn(("alarmed", {"expr": "2+3"}))
    inline = RewardRunner([], workers=0)
    assert [m["content"] for m in _step(env, ToolRunner(inline, tools), turn).messages] == ["5"]  # main thread
    assert [m["content"] for m in _step(env, ToolRunner(pool, tools), turn).messages] == ["5"]   # the pool
    with ThreadPoolExecutor(1, thread_name_prefix="rl-episodes") as t:
        with pytest.raises(ConfigError) as e:
            t.submit(_step, env, ToolRunner(inline, tools), turn).result()
    msg = e.value.message
    assert "tool 'alarmed' (tests.agent_pool_tools:alarmed) raised ValueError: signal only works in main thread" in msg
    assert "driver thread `rl-episodes_0`" in msg and "task.reward_workers=N" in msg, msg
    with pytest.raises(ConfigError, match=r"on a thread that times it out \(task.reward_timeout_s\)"):
        _step(env, ToolRunner(RewardRunner([], workers=0, timeout_s=5.0), tools), turn)
    # any other error is still the model's: it goes back as the tool's answer
    bad = _step(env, ToolRunner(inline, tools), _turn(("alarmed", {"expr": "2*3"})))
    assert bad.messages[0]["content"].startswith("error: ValueError") and bad.tool_errors == 1
