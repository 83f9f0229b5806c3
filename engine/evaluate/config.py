"""The config `rl eval` runs under: the evaluated run's own config (from its checkpoint's
manifest) or the defaults, then the overrides. Only keys that change an evaluation are taken;
any other override (an optimizer, engine or algorithm key) would do nothing, and is refused
naming what eval reads.

The task group keeps the run's task unless another is chosen (``task=dataset task.path=...``
evaluates on any data). The sampler is the torch one unless ``rollout=vllm`` is given (a run
that trained with vLLM does not make eval need it), and the device is ``trainer.device=auto``
unless given: the machine that evaluates need not be the one that trained."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from engine.config.schema import CONFIG_GROUPS, RunConfig
from engine.errors import ConfigError

# what an evaluation reads besides eval.* and task.*
READ_KEYS = ("data.max_prompt_length", "data.filter_overlong_prompts", "rollout.name", "rollout.max_new_tokens",
             "rollout.micro_batch_size", "rollout.decode_lanes", "rollout.gpu_memory_utilization", "model.dtype",
             "trainer.seed", "trainer.device", "rollout.max_turns", "rollout.max_trajectory_tokens",
             "rollout.tool_parser")
READ_PREFIXES = ("eval.", "task.")
READ_GROUPS = ("task", "rollout")


def reads(key: str) -> bool:
    """Whether `rl eval` reads config key ``key`` (a group name counts when eval reads it)."""
    return key in READ_KEYS or key.startswith(READ_PREFIXES) or key in READ_GROUPS


def eval_config(overrides: list[str], saved: Optional[dict] = None) -> RunConfig:
    """The evaluation's config: ``saved`` (a run's config as its manifest holds it; None = the
    defaults), the task/rollout groups chosen in ``overrides``, then their key=value overrides."""
    from omegaconf import OmegaConf

    from engine.config.interpolation import interpolation_error, resolve_container
    from engine.config.load import (
        _parse_value, check_group_choices, check_not_a_sweep, check_task_keys, compose_dict, config_from_dict,
        flatten, parse_override, precheck_overrides)
    from engine.config.validate import build_run_config, check_key

    overrides = list(overrides)
    check_group_choices(overrides)
    parsed = [(o, *parse_override(o)) for o in overrides]
    for o, prefix, key, _value in parsed:
        if not prefix and not reads(key):
            if key in CONFIG_GROUPS:
                raise ConfigError(f"`{o}` has no effect on `rl eval`: it evaluates the model in PATH as it is, so "
                                  f"the {key} group is not used. It reads the task and rollout groups, eval.*, "
                                  f"task.* and {', '.join(READ_KEYS)}. Drop `{o}`.", title="no effect on eval")
            check_key(key, None)  # an unknown key: "did you mean"
            raise ConfigError(f"`{o}` has no effect on `rl eval`, which evaluates the model in PATH as it is. It "
                              f"reads eval.*, task.*, {', '.join(READ_KEYS)} and the task and rollout groups. Drop "
                              f"`{o}`.", title="no effect on eval")
    groups = [o for o, _p, key, _v in parsed if key in CONFIG_GROUPS]
    keys = [o for o, _p, key, _v in parsed if key not in CONFIG_GROUPS]
    precheck_overrides(groups, None)
    if saved is None:
        data = compose_dict(groups)
    else:
        data = asdict(config_from_dict(saved))
        data["trainer"]["device"] = "auto"
        data["rollout"]["name"] = "torch"
        if groups:  # what the chosen groups set, over the run's values
            chosen, defaults = compose_dict(groups), compose_dict([])
            if chosen["task"]["name"] != data["task"]["name"]:
                data["task"] = chosen["task"]  # another task: none of the run's task keys
            flat_chosen, flat_default = flatten(chosen), flatten(defaults)
            for k, v in flat_chosen.items():
                if v != flat_default.get(k):
                    _set(data, k, v)
    data["trainer"]["loggers"] = ["console"]  # eval logs nothing; the run's loggers may not be installed here
    engine_name = (data.get("engine") or {}).get("name", "fsdp")
    base = OmegaConf.create(data)
    for o in keys:
        prefix, key, value = parse_override(o)
        if prefix:
            raise ConfigError(f"`{o}`: only plain `key=value` overrides are allowed here.", title="invalid override")
        check_key(key, engine_name)
        check_not_a_sweep(o, key, value)
        try:
            OmegaConf.update(base, key, _parse_value(value), merge=False)
        except Exception as e:  # a malformed interpolation, a value omegaconf cannot hold
            raise interpolation_error(e) from None
    from engine.config.interpolation import env_references

    refs = env_references(OmegaConf.to_container(base, resolve=False))  # type: ignore[arg-type]
    # trains=False: the trainer's token budget (engine.max_tokens_per_micro_batch) does not apply to an
    # evaluation; prompt + rollout.max_new_tokens is checked against the model's positions (run.py _check_fits)
    cfg = build_run_config(resolve_container(base), env_refs=refs, trains=False)  # errors name `${oc.env:X}`, never its value
    check_task_keys(cfg, overrides)
    check_eval_keys(cfg)
    return cfg


def _set(data: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for part in path:
        data = data.setdefault(part, {})
    data[last] = value


def check_eval_keys(cfg: RunConfig) -> None:
    """eval.* rules that involve more than one key."""
    e = cfg.eval
    if not e.greedy and not e.n:
        raise ConfigError("eval.greedy=false with eval.n=0 evaluates nothing. Keep the greedy pass, or sample with "
                          "eval.n=8 (pass@k from 8 responses per prompt).", title="invalid config")
    bad = [k for k in e.k if isinstance(k, bool) or not isinstance(k, int)]
    if bad:
        raise ConfigError(f"eval.k holds {bad[0]!r}; pass@k needs whole numbers of samples, e.g. eval.k=[1,4].",
                          title="invalid config value")
    if e.k and not e.n:
        raise ConfigError(f"eval.k={list(e.k)} asks for pass@k, which needs a sampled pass: add eval.n (responses "
                          f"per prompt, at least {max(e.k)}).", title="invalid config")
    over = [k for k in e.k if k > e.n]
    if over:
        raise ConfigError(f"eval.k={list(e.k)}: pass@{over[0]} needs at least {over[0]} responses per prompt, and "
                          f"eval.n={e.n}. Raise eval.n to {max(e.k)} or drop k > {e.n}.", title="invalid config")


def refuse_eval_keys(overrides: list[str]) -> None:
    """`rl train` with eval.* overrides: they would do nothing there (eval reads them)."""
    from engine.config.load import parse_override

    for o in overrides:
        if parse_override(o)[1].startswith("eval."):
            raise ConfigError(f"`{o}` is read by `rl eval`, not by `rl train` (whose held-out validation is "
                              f"trainer.val_freq). Evaluate the run's checkpoint afterwards: `rl eval <checkpoint.dir> "
                              f"{o}`.", title="no effect on train")
