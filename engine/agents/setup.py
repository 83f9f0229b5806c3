"""What a run with ``task.tools`` or ``task.environment`` needs, built once on the driver from the
config and the tokenizer: the tools, the parser, the renderer, the environment factory and the
stop tokens the samplers end a turn at (besides EOS)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from engine.config.lengths import trajectory_tokens
from engine.errors import ConfigError


@dataclass
class AgentSetup:
    tools: dict
    schemas: list
    parser: object
    renderer: object
    make_env: object
    stop_ids: list[int] = field(default_factory=list)
    max_turns: int = 1
    max_tokens: int = 0
    run_tools: object = None  # engine.agents.tool_calls.ToolRunner (None: on the driver, inline)

    def encode_prompts(self, examples: list, ids: list[list[int]]) -> list[list[int]]:
        """With a chat template and tools, the prompts rendered with the tools' schemas (the template
        shows them to the model); otherwise ``ids`` as they are."""
        from engine.agents.render import ChatRenderer

        if not (self.schemas and isinstance(self.renderer, ChatRenderer)):
            return ids
        return [self.renderer.prompt(e.prompt if isinstance(e.prompt, list) else [{"role": "user", "content": e.prompt}])
                for e in examples]

    def use_reward_executors(self, rewards) -> None:
        """Run tool calls where ``rewards`` (the run's RewardRunner) runs reward functions: its
        process pool and timeout (engine/agents/tool_calls.py)."""
        from engine.agents.tool_calls import ToolRunner

        self.run_tools = ToolRunner(rewards, self.tools)

    def run(self, generate, prompts, rows, n, tokenizer):
        from engine.agents.loop import run_episodes

        return run_episodes(generate, prompts, rows, n, self.make_env, self.renderer, tokenizer.decode,
                            max_turns=self.max_turns, max_tokens=self.max_tokens, pad_token_id=tokenizer.pad_token_id,
                            run_tools=self.run_tools)


def agent_setup(cfg, tokenizer, task_tools: list | None = None, task_env: str = "") -> AgentSetup | None:
    """None for a single-turn run (no tools, no environment). ``task_tools``, ``task_env``: the
    tools and environment a built-in task brings (used when task.tools / task.environment are not set)."""
    from engine.agents.environment import ToolEnvironment
    from engine.agents.parsers import make_parser
    from engine.agents.render import make_renderer
    from engine.agents.tools import load_tool, tool_schema

    specs, env_spec = list(cfg.task.tools), cfg.task.environment or (task_env if not cfg.task.tools else "")
    fns = [load_tool(s) for s in specs] if specs else list(task_tools or [])
    if not fns and not env_spec:
        return None
    tools = {f.__name__: f for f in fns}
    schemas = [tool_schema(f) for f in fns]
    parser = make_parser(cfg.rollout.tool_parser, tokenizer) if tools else None
    if parser is not None and parser.name == "compact" and len(tools) != 1:
        raise ConfigError(f"rollout.tool_parser=compact calls the one tool of the task, but {len(tools)} are set "
                          f"({', '.join(tools)}). Give one tool, or use a model whose chat template speaks a "
                          f"tool-call format (hermes).", title="invalid tools")
    renderer = make_renderer(tokenizer, schemas)
    stop_ids: list[int] = []
    if parser is not None and parser.stop_text:
        ids = list(tokenizer.encode(parser.stop_text))
        if len(ids) != 1 or ids[0] == getattr(tokenizer, "unk_token_id", None):
            raise ConfigError(f"the {parser.name} tool-call format ends a call with {parser.stop_text!r}, which is not "
                              f"one token of this tokenizer. Use a tokenizer that has it as one token, or another "
                              f"rollout.tool_parser.", title="invalid tools")
        stop_ids = ids
    if env_spec:
        cls = _load_env(env_spec)
        make_env = cls
    else:
        make_env = lambda: ToolEnvironment(tools, parser)  # noqa: E731
    return AgentSetup(tools, schemas, parser, renderer, make_env, stop_ids,
                      max_turns=cfg.rollout.max_turns, max_tokens=trajectory_tokens(cfg))


def _load_env(spec: str):
    import sys

    from engine.agents.environment import Environment

    mod, _, name = spec.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"task.environment={spec!r} cannot be imported ({e}). Write module:Class, the module "
                          f"importable from the current directory.", title="environment not found") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"task.environment={spec!r} is not a subclass of engine.agents.environment.Environment "
                          f"(reset(row) -> messages, step(messages) -> EnvStep).", title="invalid environment")
    return cls
