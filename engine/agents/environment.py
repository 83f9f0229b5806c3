"""The environment interface: what a multi-turn task plugs into the rollout loop.

An environment sees the conversation as chat messages (``{"role", "content"}``), never tokens:

- ``reset(row) -> messages | None``: the opening messages for a dataset row (None: the task's
  own prompt, as single-turn runs encode it);
- ``step(messages) -> EnvStep``: called after each model turn (the last message is the model's,
  role ``assistant``); returns the messages to append (tool results, a game's next observation),
  a reward or None, and whether the episode is over.

The loop (engine/agents/loop.py) renders the new messages through the chat template and appends
their tokens, masked out of the loss. ``task.environment=module:Class`` plugs your own (built with
no arguments, one instance per trajectory); ``task.tools`` uses ``ToolEnvironment``.

The loop calls ``begin(messages) -> PendingStep`` rather than ``step``: a step whose tool calls run
elsewhere. ``ToolEnvironment`` hands its calls out, so the loop runs every trajectory's calls of a
turn together where reward functions run (engine/agents/tool_calls.py: the process pool, with its
timeout); any other environment's ``begin`` is its ``step``, run in the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.agents.parsers import ToolCall
from engine.agents.tools import ToolResult, run_tool


@dataclass
class EnvStep:
    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = True
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0


@dataclass
class PendingStep:
    """A step waiting for its tool calls: ``calls`` is ``[(function, ToolCall)]`` to run (with every
    other trajectory's), ``finish(results)`` makes the step from their ``ToolResult``s, in order."""

    calls: list = field(default_factory=list)
    finish: Callable[[list], EnvStep] = lambda results: EnvStep()


class Environment:
    def reset(self, row) -> list[dict] | None:
        return None

    def step(self, messages: list[dict]) -> EnvStep:  # pragma: no cover - interface
        raise NotImplementedError

    def begin(self, messages: list[dict]) -> PendingStep:
        """What the loop calls after a model turn; by default the step itself, now (no calls to run)."""
        out = self.step(messages)
        return PendingStep([], lambda results: out)


class ToolEnvironment(Environment):
    """The tool loop as an environment: a turn with tool calls gets one ``tool`` message per call
    (its result, or what was wrong); a turn without any ends the episode."""

    def __init__(self, tools: dict, parser):
        self.tools, self.parser = tools, parser

    def begin(self, messages: list[dict]) -> PendingStep:
        parsed = self.parser.parse(messages[-1]["content"], self.tools)
        if not parsed.wants_tools:
            return PendingStep([], lambda results: EnvStep(done=True))
        known = [c for c in parsed.calls if c.name in self.tools]

        def finish(results: list[ToolResult]) -> EnvStep:
            out = EnvStep(done=False)
            for msg in parsed.errors:
                out.messages.append({"role": "tool", "content": f"error: {msg}"})
                out.tool_errors += 1
            done = iter(results)
            for call in parsed.calls:
                res = next(done) if call.name in self.tools else run_tool(self.tools, call)  # unknown: its error
                out.messages.append({"role": "tool", "name": call.name, "content": res.content})
                out.tool_calls += 1
                out.tool_errors += int(res.error)
                out.tool_timeouts += int(res.timeout)
            return out

        return PendingStep([(self.tools[c.name], c) for c in known], finish)

    def step(self, messages: list[dict]) -> EnvStep:
        """The step on its own, its calls run here, one after another."""
        pending = self.begin(messages)
        return pending.finish([run_tool(self.tools, c) for _, c in pending.calls])


__all__ = ["Environment", "EnvStep", "PendingStep", "ToolEnvironment", "ToolCall"]
