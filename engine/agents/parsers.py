"""Tool calls in a model's output, in the format its chat template uses: a registry of parsers.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
  (the Hermes format, used by the Qwen2.5/Qwen3 templates). The turn ends at EOS (the template's
  end of turn), so the tool message follows the turn exactly as the template renders it.
- ``compact``: the built-in character tokenizer has no chat template; a turn that ends with ``]``
  is a call of the task's one tool, its one argument the text after the turn's last ``[`` (the
  whole turn without one). The turn stops at ``]`` (a stop
  token kept in the response), and the tool's result is appended as plain text.

A parser returns the calls it found and any it could not read (counted as tool errors; the
model is told what was wrong, as the tool message).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine import json_safe


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # calls that could not be read, one message each

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.errors)


class HermesParser:
    name = "hermes"
    stop_text = ""  # the turn ends at EOS
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str, tools: dict) -> ParsedTurn:
        out = ParsedTurn()
        for body in self._block.findall(text):
            try:
                obj = json_safe.loads(body)  # a model's deeply nested output is unreadable, not a RecursionError
                name, args = obj["name"], obj.get("arguments", {})
                if isinstance(args, str):
                    args = json_safe.loads(args)
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise ValueError("name must be a string and arguments an object")
            except (ValueError, KeyError, TypeError) as e:
                out.errors.append(f"unreadable tool call {body[:80]!r}: {e}")
                continue
            out.calls.append(ToolCall(name, args))
        return out


class CompactParser:
    name = "compact"
    stop_text = "]"

    def parse(self, text: str, tools: dict) -> ParsedTurn:
        out = ParsedTurn()
        if not text.endswith("]"):
            return out
        arg = text[text.rindex("[") + 1 if "[" in text else 0:-1]
        (name, fn), = tools.items()
        import inspect

        param = next(iter(inspect.signature(fn).parameters))
        out.calls.append(ToolCall(name, {param: arg}))
        return out


PARSERS = {"hermes": HermesParser, "compact": CompactParser}


def make_parser(name: str, tokenizer):
    """The parser ``rollout.tool_parser`` names; ``auto``: hermes when the tokenizer's chat template
    speaks ``<tool_call>``, compact for a tokenizer without a chat template (the built-in one)."""
    from engine.data.prompts import has_chat_template, hf_tokenizer_of
    from engine.errors import ConfigError

    if name == "auto":
        if not has_chat_template(tokenizer):
            name = "compact"
        elif "<tool_call>" in str(hf_tokenizer_of(tokenizer).chat_template):
            name = "hermes"
        else:
            raise ConfigError("task.tools is set, but this tokenizer's chat template has no tool-call format rl "
                              f"can parse (known: {', '.join(PARSERS)}). Set rollout.tool_parser to one of them "
                              "if the model writes that format, or use a model whose template supports tools "
                              "(Qwen2.5/Qwen3, Hermes).", title="no tool-call parser")
    if name not in PARSERS:
        raise ConfigError(f"rollout.tool_parser={name} is not a known parser. Choose one of: auto, "
                          f"{', '.join(PARSERS)}.", title="unknown tool parser")
    return PARSERS[name]()
