"""Task name -> builder."""

from __future__ import annotations

from engine.config.schema import TaskConfig
from engine.tasks.base import Task


def make_task(cfg: TaskConfig, seed: int) -> Task:
    if cfg.name == "echo":
        from engine.tasks.builtin import make_echo_task
        return make_echo_task(cfg, seed)
    if cfg.name == "add":
        from engine.tasks.builtin import make_add_task
        return make_add_task(cfg, seed)
    if cfg.name == "arith":
        from engine.tasks.arith import make_arith_task
        return make_arith_task(cfg, seed)
    if cfg.name == "sort":
        from engine.tasks.sort_digits import make_sort_task
        return make_sort_task(cfg, seed)
    if cfg.name == "tool_add":
        from engine.tasks.tool_add import make_tool_add_task
        return make_tool_add_task(cfg, seed)
    from engine.tasks.dataset import make_dataset_task
    return make_dataset_task(cfg, seed)
