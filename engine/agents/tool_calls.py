"""Where the agent loop's tool calls run: where reward functions run.

Every call of a turn -- all trajectories' at once -- goes to the run's reward executors
(engine/rewards/executors.py): with ``task.reward_workers>=1`` the process pool, in parallel, each
call bounded by ``task.reward_timeout_s`` (a hung or crashing call's worker is killed and replaced,
the other calls carry on); with ``reward_workers=0`` on the driver, one after another, watched with
the timeout when one is set (a hung call's thread is abandoned).

A call that raises, times out or whose worker dies is the model's problem, never the run's: its
error goes back to the model as the tool's message and is counted (``agent_tool_errors``; timeouts
also as ``agent_tool_timeouts``), whatever ``task.reward_on_error`` says -- as verl's tool agent
loop and TRL's tool calling do. ``reward_on_error`` is about scoring; a tool's failure is
something the policy can learn to avoid. One exception: a tool that sets a signal handler (a
``signal.alarm`` timeout) called off the main thread (engine/rewards/main_thread.py) fails on
every call whatever the model wrote, so the run stops with the fix instead of training on it.
"""

from __future__ import annotations

import pickle

from engine.agents.tools import ToolResult
from engine.errors import ConfigError
from engine.rewards.main_thread import off_main_thread_fix


def call_tool(fn, arguments: dict) -> tuple:
    """One call, in whatever process runs it: an executor outcome (``("ok", text)`` or ``("err",
    message, "")``)."""
    try:
        return ("ok", str(fn(**arguments)))
    except Exception as e:  # noqa: BLE001 - the model's call was wrong: it is told
        return ("err", f"{type(e).__name__}: {e}", "")


class ToolRunner:
    """Runs a batch of ``(function, ToolCall)`` and returns one ``ToolResult`` each, in order.
    ``rewards``: the run's RewardRunner, whose executors run the calls; None: on the driver, inline."""

    def __init__(self, rewards=None, tools: dict | None = None):
        self.rewards = rewards
        self.timeout_s = getattr(rewards, "timeout_s", 0.0) if rewards is not None else 0.0
        if rewards is not None and getattr(rewards, "workers", 0) > 0:
            for name, fn in (tools or {}).items():  # the pool gets each function by reference
                try:
                    pickle.dumps(fn)
                except Exception as e:  # noqa: BLE001
                    raise ConfigError(
                        f"tool {name!r} cannot be sent to the reward process pool (task.reward_workers="
                        f"{rewards.workers}): {type(e).__name__}: {e}. A tool must be a module-level function "
                        f"importable by its module path (task.tools=[module:function]); or set "
                        f"task.reward_workers=0 to run tools on the driver.", title="invalid tool") from None

    def __call__(self, calls: list[tuple]) -> list[ToolResult]:
        jobs = [(fn, dict(c.arguments)) for fn, c in calls]
        if not jobs:
            return []
        outcomes = self.rewards.execute(call_tool, jobs) if self.rewards is not None else [call_tool(*j) for j in jobs]
        for (fn, c), o in zip(calls, outcomes):
            self._refuse_main_thread_only(fn, c, o)
        return [self._result(o) for o in outcomes]

    def _refuse_main_thread_only(self, fn, call, outcome) -> None:
        if outcome is None or outcome[0] != "err" or getattr(self.rewards, "workers", 0) > 0:
            return
        fix = off_main_thread_fix(outcome[1], watched=bool(self.timeout_s))
        if fix:
            raise ConfigError(
                f"tool {call.name!r} ({fn.__module__}:{fn.__qualname__}) raised {outcome[1]}. {fix}. Every call "
                f"would fail the same way whatever the model wrote, so the run stops rather than hand the model "
                f"this error as the tool's answer.", title="tool needs the main thread")

    def _result(self, outcome) -> ToolResult:
        if outcome is not None and outcome[0] == "ok":
            return ToolResult(outcome[1], False)
        if outcome is not None and outcome[0] == "timeout":
            return ToolResult(f"error: the tool gave no result within {self.timeout_s:g} s", True, timeout=True)
        return ToolResult(f"error: {outcome[1] if outcome is not None else 'not run'}", True)
