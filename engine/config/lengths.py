"""How long a row of a run's batches can be: one number that the buckets, the vLLM engine's
context, the model's position check, the padding validation and the memory estimate all share.

A single-turn row is a prompt and one response: ``data.max_prompt_length + rollout.max_new_tokens``.
A multi-turn row (task.tools, task.environment, or a built-in task that brings its tools) holds the
prompt and then every model turn and environment message: the *trajectory budget*,
``rollout.max_trajectory_tokens``, or ``rollout.max_turns x rollout.max_new_tokens`` when that is 0.
The loop stops a trajectory at the budget (engine/agents/loop.py), so tool output cannot make a row
longer than what the buckets and the samplers were sized for.
"""

from __future__ import annotations

from engine.config.schema import RunConfig

TASKS_WITH_TOOLS = ("tool_add",)  # built-in tasks that bring their own tools (engine/tasks/registry.py)


def is_multi_turn(cfg: RunConfig) -> bool:
    """The run samples trajectories of several turns (engine/agents) instead of single responses."""
    return bool(cfg.task.tools or cfg.task.environment or cfg.task.name in TASKS_WITH_TOOLS)


def trajectory_tokens(cfg: RunConfig) -> int:
    """Tokens after the prompt a row holds at most: the response, or a trajectory's budget."""
    r = cfg.rollout
    if not is_multi_turn(cfg):
        return r.max_new_tokens
    return r.max_trajectory_tokens or r.max_turns * r.max_new_tokens


def longest_sequence(cfg: RunConfig) -> int:
    """The longest row (prompt + everything after it) a batch of this run can hold."""
    return cfg.data.max_prompt_length + trajectory_tokens(cfg)


def sampler_context(cfg: RunConfig) -> int:
    """Positions a sampler needs: the longest row, and in a multi-turn run one more turn beyond a
    trajectory just under its budget (the loop cuts that turn back to the budget afterwards)."""
    return longest_sequence(cfg) + (cfg.rollout.max_new_tokens if is_multi_turn(cfg) else 0)
