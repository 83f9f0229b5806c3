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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.agents.parsers import ToolCall
from engine.agents.tools import run_tool


@dataclass
class EnvStep:
    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = True
    tool_calls: int = 0
    tool_errors: int = 0


class Environment:
    def reset(self, row) -> list[dict] | None:
        return None

    def step(self, messages: list[dict]) -> EnvStep:  # pragma: no cover - interface
        raise NotImplementedError


class ToolEnvironment(Environment):
    """The tool loop as an environment: a turn with tool calls gets one ``tool`` message per call
    (its result, or what was wrong); a turn without any ends the episode."""

    def __init__(self, tools: dict, parser):
        self.tools, self.parser = tools, parser

    def step(self, messages: list[dict]) -> EnvStep:
        parsed = self.parser.parse(messages[-1]["content"], self.tools)
        if not parsed.wants_tools:
            return EnvStep(done=True)
        out = EnvStep(done=False)
        for msg in parsed.errors:
            out.messages.append({"role": "tool", "content": f"error: {msg}"})
            out.tool_errors += 1
        for call in parsed.calls:
            res = run_tool(self.tools, call)
            out.messages.append({"role": "tool", "name": call.name, "content": res.content})
            out.tool_calls += 1
            out.tool_errors += int(res.error)
        return out


__all__ = ["Environment", "EnvStep", "ToolEnvironment", "ToolCall"]
