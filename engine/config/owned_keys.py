"""Keys that only some options of a config group read, and the error for setting one of them
while another option is chosen (it would do nothing).

    owned_keys()["rollout.gpu_memory_utilization"]  # {"rollout": ("vllm",)}
    check_overrides_take_effect(cfg, ["rollout.gpu_memory_utilization=0.6"])  # ConfigError with rollout=torch

The rules are declared once, in the schema (engine/config/schema.py): ``metadata["only_for"]``
on a field, or on a section's field of RunConfig for every key of that section (critic.* is
read by algorithm=ppo alone). Only what the user sets counts (command-line overrides, a
--config file's values away from what its groups give): the defaults and the presets of the
chosen groups hold every key, read or not.
"""

from __future__ import annotations

import functools
from dataclasses import fields

from engine.config.schema import ENGINE_CONFIGS, RunConfig, nested_section
from engine.errors import ConfigError


@functools.lru_cache(maxsize=None)
def owned_keys() -> dict[str, dict[str, tuple[str, ...]]]:
    """Every key read by only some options of a group -> {group: options that read it}."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for section in fields(RunConfig):
        classes = list(ENGINE_CONFIGS.values()) if section.name == "engine" else [section.default_factory]
        for cls in classes:
            _walk(cls, section.name, _rule(section), out)
    return out


def _rule(f) -> dict[str, tuple[str, ...]]:
    return {group: tuple(options) for group, options in f.metadata.get("only_for", {}).items()}


def _walk(cls, prefix: str, inherited: dict, out: dict) -> None:
    for f in fields(cls):
        key = f"{prefix}.{f.name}"
        rule = {**inherited, **_rule(f)}
        sub = nested_section(f)
        if sub is not None:
            _walk(sub, key, rule, out)
        elif rule:
            out[key] = rule


def chosen_option(cfg: RunConfig, group: str) -> str:
    """The option ``cfg`` has chosen for ``group``: a config group (its section's ``name``), or a
    choice field (``trainer.mode``)."""
    section, _, key = group.partition(".")
    return getattr(getattr(cfg, section), key or "name")


def ignored_by(cfg: RunConfig, key: str) -> tuple[str, tuple[str, ...], str] | None:
    """(group, the options that read ``key``, the chosen option) when the chosen option of a
    group does not read ``key``; None when the run reads it."""
    for group, options in owned_keys().get(key, {}).items():
        chosen = chosen_option(cfg, group)
        if chosen not in options:
            return group, options, chosen
    return None


def _choose(group: str, option: str) -> str:
    return f"`--engine {option}`" if group == "engine" else f"`{group}={option}`"


def no_effect_error(cfg: RunConfig, key: str, written: str) -> ConfigError | None:
    """The error for ``written`` (how the user set ``key``) when the run would ignore it."""
    found = ignored_by(cfg, key)
    if found is None:
        return None
    group, options, chosen = found
    readers = " or ".join(f"{group}={o}" for o in options)
    fix = " or ".join(_choose(group, o) for o in options)
    return ConfigError(
        f"`{written}` has no effect: `{key}` is read only with {readers}, and this run's {group} is `{chosen}`, "
        f"which ignores it. To use it choose {fix}; otherwise drop `{key}`.", title="override has no effect")


def check_overrides_take_effect(cfg: RunConfig, overrides: list[str]) -> None:
    """Refuse the first ``key=value`` override that the run's chosen engine, rollout or
    algorithm ignores (group choices such as ``rollout=vllm`` are not keys and pass)."""
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0].strip()
        err = no_effect_error(cfg, key, o)
        if err is not None:
            raise err
