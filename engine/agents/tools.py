"""Tools: plain Python functions with type hints and a docstring (``task.tools=[module:function]``).

Their JSON schema is what transformers makes of them (``transformers.utils.get_json_schema``,
what ``apply_chat_template(tools=...)`` uses), so the chat template shows the model exactly the
signature it would show in any other transformers code. A call that raises returns its error to
the model as the tool's message and is counted as a tool error.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from engine.agents.parsers import ToolCall
from engine.errors import ConfigError


def load_tool(spec: str):
    """``module:function`` -> the function (cwd importable), refused clearly when it is not one."""
    if ":" not in spec:
        raise ConfigError(f"task.tools entry {spec!r} is not module:function. Write e.g. "
                          f"task.tools=[mytools:calculator].", title="invalid tool")
    mod, _, name = spec.partition(":")
    import sys

    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task.tools entry {spec!r} cannot be imported ({e}). Check the module is importable "
                          f"from the current directory and defines {name}.", title="tool not found") from None
    if not callable(fn):
        raise ConfigError(f"task.tools entry {spec!r} is not a function.", title="invalid tool")
    tool_schema(fn, spec)
    return fn


def tool_schema(fn, spec: str = "") -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ConfigError(f"tool {spec or fn.__name__} has no schema transformers can read ({e}). A tool needs "
                          f"type hints on every argument and a docstring with an Args: section describing "
                          f"each one (as for apply_chat_template(tools=...)).", title="invalid tool") from None


@dataclass
class ToolResult:
    content: str
    error: bool
    timeout: bool = False  # no result within task.reward_timeout_s (engine/agents/tool_calls.py)


def run_tool(tools: dict, call: ToolCall) -> ToolResult:
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(f"error: no tool named {call.name!r} (tools: {', '.join(tools)})", True)
    try:
        return ToolResult(str(fn(**call.arguments)), False)
    except Exception as e:  # the model's call was wrong: it is told, and it is counted
        return ToolResult(f"error: {type(e).__name__}: {e}", True)
