"""Strict validation of a composed config against the typed schema.

Turns a plain nested dict into a RunConfig, or raises ConfigError with a message a user can
act on: unknown keys get "did you mean", removed keys name their replacement, wrong types and
out-of-range values name the key, what was given and what is allowed.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from engine.config.foreign_keys import foreign_message
from engine.config.lengths import is_multi_turn, longest_sequence
from engine.config.removed_keys import removed_message
from engine.config.schema import ENGINE_CONFIGS, RunConfig, nested_section, section_types
from engine.errors import ConfigError

GROUP_BASELINE_ALGORITHMS = ("grpo", "dr_grpo", "rloo", "dapo")  # advantages within a prompt's group


def all_keys(engine_name: str | None = None, include_all_engines: bool = True) -> dict[str, Any]:
    """Every leaf key ``section.field`` mapped to its dataclass field (engines merged)."""
    out: dict[str, Any] = {}
    for section, cls in section_types(engine_name).items():
        classes = list(ENGINE_CONFIGS.values()) if (section == "engine" and include_all_engines) else [cls]
        for c in classes:
            _leaf_keys(c, section, out)
    return out


def _leaf_keys(cls, prefix: str, out: dict) -> None:
    for f in fields(cls):
        sub = nested_section(f)
        if sub is not None:
            _leaf_keys(sub, f"{prefix}.{f.name}", out)
        else:
            out.setdefault(f"{prefix}.{f.name}", f)


def nested_sections(engine_name: str | None = None) -> set[str]:
    """Dotted names of sections inside sections (``model.lora``)."""
    found = set()
    for section, cls in section_types(engine_name).items():
        for f in fields(cls):
            if nested_section(f) is not None:
                found.add(f"{section}.{f.name}")
    return found


def suggest(key: str, candidates: list[str]) -> str:
    """' Did you mean `x`?' or '' — matched on the full key and on its last segment."""
    best = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not best:
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        leaf_match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.7)
        best = [by_leaf[leaf_match[0]]] if leaf_match else []
    return f" Did you mean `{best[0]}`?" if best else ""


def suggest_option(group: str, value: str, options: list[str]) -> str:
    """What to say about ``group=value`` that names no option of the group: when ``value`` is a
    choice of one of the group section's keys (``algorithm=gspo``: a value of ``algorithm.loss``),
    that key; else the closest option."""
    from engine.config.schema import CONFIG_GROUP_DEFAULTS

    for f in fields(section_types().get(group) or object):
        if f.name != "name" and value in (f.metadata.get("choices") or ()):
            example = f"{group}={CONFIG_GROUP_DEFAULTS.get(group, options[0])} {group}.{f.name}={value}"
            return (f" `{value}` is a value of `{group}.{f.name}`: set `{group}.{f.name}={value}` beside any "
                    f"{group} option (e.g. `{example}`).")
    return suggest(value, options)


def check_key(key: str, engine_name: str | None, value: str = "") -> None:
    """Raise ConfigError if ``key`` is removed or not in the schema (``value``: what the override
    set it to, for the fix a verl or TRL name gets)."""
    msg = removed_message(key)
    if msg:
        raise ConfigError(msg, title="removed config key")
    keys = all_keys(engine_name, include_all_engines=False)
    if key in keys:
        return
    msg = foreign_message(key, value)
    if msg:
        raise ConfigError(msg, title="unknown config key")
    sections = section_types(engine_name)
    if key in sections or key in nested_sections(engine_name):
        return
    head = key.split(".", 1)[0]
    if head not in sections:
        inside = sorted(k for k in keys if k.endswith("." + key))  # `lora.rank` is model.lora.rank
        hint = f" Did you mean `{inside[0]}`?" if len(inside) == 1 else suggest(head, list(sections))
        raise ConfigError(
            f"Unknown config section `{head}` in `{key}`.{hint} "
            f"Sections are: {', '.join(sections)}. See `rl train --help` or docs/config-reference.md.",
            title="unknown config key")
    other = all_keys(None, include_all_engines=True)
    if key in other and head == "engine":
        readers = [name for name in ENGINE_CONFIGS if key in all_keys(name, include_all_engines=False)]
        raise ConfigError(
            f"`{key}` has no effect: it is read only with {' or '.join(f'engine={n}' for n in readers)}, and this "
            f"run's engine is `{engine_name}`, which has no such key. To use it choose "
            f"{' or '.join(f'`--engine {n}`' for n in readers)}; otherwise drop `{key}`.",
            title="override has no effect")
    raise ConfigError(
        f"Unknown config key `{key}`.{suggest(key, list(keys))} "
        f"Run `rl train --help` or see docs/config-reference.md for every key.",
        title="unknown config key")


def _type_name(f) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def coerce_value(key: str, f, value: Any, secret: str | None = None) -> Any:
    """Check ``value`` against field ``f``'s type and limits; return the coerced value.
    ``secret``: the interpolation (``${oc.env:NAME}``) the value was read through; an error
    then names it and never shows the value."""
    if secret is not None:
        try:
            return coerce_value(key, f, value)
        except ConfigError as e:
            raise _secret_value_error(key, f, value, secret, e) from None
    tname = _type_name(f).replace("Optional[", "").rstrip("]")
    meta = f.metadata
    allowed = ""
    ok = True
    v = value
    if tname == "bool":
        ok = isinstance(v, bool)
        allowed = "true or false"
    elif tname == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
        allowed = "an integer"
    elif tname == "float":
        if isinstance(v, str) and _NON_FINITE.fullmatch(v.strip()):
            # `nan`/`inf` as text (YAML and `rl eval`/`rl resume` overrides read them so; Hydra's `rl train`
            # overrides give a float): the same "finite number" refusal below, not "must be a number; got 'nan'"
            v = value = float(v.strip().replace(".", ""))
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok:
            v = float(v)
        allowed = "a number"
    elif tname == "str":
        if isinstance(v, bool) and ("on" if v else "off") in meta.get("choices", ()):
            v = "on" if v else "off"  # YAML 1.1 reads an unquoted off/on as a boolean
        ok = isinstance(v, str) or (v is None)
        v = "" if v is None else v
        if ok and meta.get("expand_user"):  # a path: `~/runs/a` is the home's, as model.path and task.path are
            # (it was a directory literally named `~` in the current one)
            v = os.path.expanduser(v)
        allowed = "a string"
    elif tname == "list":
        ok = isinstance(v, (list, tuple))
        v = list(v) if ok else v
        default = _default_of(f)
        allowed = f"a list, e.g. {key}={_fmt(default)}" if default else "a list, e.g. [a,b]"
    if not ok:
        raise ConfigError(
            f"`{key}` must be {allowed}; got {_short(value)} ({type(value).__name__}). "
            f"Default: {key}={_fmt(_default_of(f))}. Help: {meta.get('help', '')}.",
            title="invalid config value")
    if "choices" in meta and v not in meta["choices"]:
        raise ConfigError(
            f"`{key}` must be one of {', '.join(map(str, meta['choices']))}; got {_short(value)}."
            f"{suggest(str(value), [str(c) for c in meta['choices']]) if isinstance(value, str) else ''}",
            title="invalid config value")
    if tname == "float" and not math.isfinite(v):  # before the bounds: `inf` is not "must be <= 1"
        raise ConfigError(f"`{key}` {_value_problem(tname, v, meta)}; got {_short(value)}. Default: "
                          f"{key}={_fmt(_default_of(f))}. Help: {meta.get('help', '')}.", title="invalid config value")
    if "min" in meta and v < meta["min"]:
        raise ConfigError(f"`{key}` must be >= {meta['min']}; got {_short(value)}. ({meta.get('help', '')})",
                          title="invalid config value")
    if "above" in meta and v <= meta["above"]:
        raise ConfigError(f"`{key}` must be > {meta['above']}; got {_short(value)}. ({meta.get('help', '')}) "
                          f"Default: {key}={_fmt(_default_of(f))}.", title="invalid config value")
    if "max" in meta and v > meta["max"]:
        raise ConfigError(f"`{key}` must be <= {meta['max']}; got {_short(value)}. ({meta.get('help', '')})",
                          title="invalid config value")
    problem = _value_problem(tname, v, meta)
    if problem:
        raise ConfigError(f"`{key}` {problem}; got {_short(value)}. Default: {key}={_fmt(_default_of(f))}. "
                          f"Help: {meta.get('help', '')}.", title="invalid config value")
    return v


def _secret_value_error(key: str, f, value: Any, secret: str, e: ConfigError) -> ConfigError:
    """The error about a value read from the environment: what the key takes, the interpolation
    that gave the value, and never the value (it may be a token)."""
    tname = _type_name(f).replace("Optional[", "").rstrip("]")
    meta = f.metadata
    if "choices" in meta:
        takes = f"one of {', '.join(map(str, meta['choices']))}"
    else:
        takes = {"int": "an integer", "float": "a number", "bool": "true or false", "list": "a list",
                 "str": "a string"}.get(tname, f"a {tname}")
        limits = [f">= {meta['min']}" if "min" in meta else "", f"> {meta['above']}" if "above" in meta else "",
                  f"<= {meta['max']}" if "max" in meta else ""]
        takes += "".join(f", {x}" for x in limits if x)
    hint = ""
    if isinstance(value, str) and tname in ("int", "float", "bool", "list"):
        inner = secret[2:-1] if secret.startswith("${") and secret.endswith("}") else secret
        hint = (f" `${{oc.env:NAME}}` always gives a string; to read {takes.split(',')[0]} from the environment "
                f"write `'{key}=${{oc.decode:${{{inner}}}}}'`.") if _ENV_ONLY.fullmatch(secret) else ""
    return ConfigError(
        f"`{key}={secret}`: the value read from the environment does not fit `{key}`, which takes {takes} "
        f"({type(value).__name__} given; the value is not shown: values read from the environment are kept "
        f"secret).{hint} Default: {key}={_fmt(_default_of(f))}. Help: {meta.get('help', '')}.",
        title=e.title)


_NON_FINITE = re.compile(r"[-+]?\.?(nan|inf|infinity)", re.IGNORECASE)
_ENV_ONLY = re.compile(r"\$\{\s*(?:oc\.)?env\s*:[^${}]*\}")

INT64_MAX = 2**63 - 1


def _value_problem(tname: str, v: Any, meta: dict) -> str:
    """What is wrong with a value of the right type: non-finite, beyond int64, bad list items."""
    if tname == "float" and not math.isfinite(v):
        return "must be a finite number (nan and inf are not)"
    if tname == "int" and abs(v) > INT64_MAX:
        return f"must fit in 64 bits (|value| <= {INT64_MAX})"
    if tname == "str" and "\x00" in v:
        return "must not contain a NUL character"
    if tname == "list":
        if "length" in meta and len(v) != meta["length"]:
            return f"must hold exactly {meta['length']} items"
        for item in v:
            if isinstance(item, float) and not math.isfinite(item):
                return "must hold finite numbers (nan and inf are not)"
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                if "item_min" in meta or "item_below" in meta:
                    return "must hold finite numbers"
                continue
            if "item_min" in meta and item < meta["item_min"]:
                return f"items must be >= {meta['item_min']}"
            if "item_below" in meta and item >= meta["item_below"]:
                return f"items must be < {meta['item_below']}"
    return ""


def _default_of(f) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING


def _short(v: Any, limit: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _fmt(v: Any) -> str:
    if v is MISSING:
        return "?"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    return str(v)


def build_run_config(data: dict, *, check_environment: bool = True, env_refs: dict | None = None,
                     trains: bool = True) -> RunConfig:
    """Validate a plain nested dict (every section optional) into a RunConfig.
    ``check_environment=False``: a config that is read, not run here (a checkpoint's saved config
    before `rl resume` applies its overrides, config.yaml for `rl mem-report`, a rank's copy):
    the loggers' packages and settings (WANDB_MODE) belong to the machine and run that open them.
    ``env_refs``: key -> the interpolation its value was read from the environment through
    (engine.config.interpolation.env_references): errors about those keys never show the value.
    ``trains=False``: a config nothing trains under (`rl eval`): the trainer's micro-batch token
    budget (engine.*) does not apply, so a sequence longer than it is not refused here."""
    engine_name = (data.get("engine") or {}).get("name", "fsdp")
    if engine_name not in ENGINE_CONFIGS:
        raise ConfigError(
            f"`engine.name` must be one of {', '.join(ENGINE_CONFIGS)}; got {engine_name!r}."
            f"{suggest(str(engine_name), list(ENGINE_CONFIGS))}", title="invalid config value")
    sections = section_types(engine_name)
    built = {}
    for section, value in data.items():
        if section not in sections:
            check_key(section, engine_name)  # raises with a suggestion
        if not isinstance(value, dict):
            raise ConfigError(f"`{section}` must be a mapping of keys; got {value!r}.", title="invalid config")
    for section, cls in sections.items():
        built[section] = _build_section(cls, data.get(section) or {}, section, engine_name, env_refs or {})
    cfg = RunConfig(**built)
    check_cross_field(cfg, check_environment=check_environment, trains=trains)
    return cfg


def _build_section(cls, values: dict, prefix: str, engine_name: str, env_refs: dict):
    kwargs = {}
    known = {f.name: f for f in fields(cls)}
    for k, v in values.items():
        key = f"{prefix}.{k}"
        if k not in known:
            check_key(key, engine_name)
        sub = nested_section(known[k])
        if sub is not None:
            if not isinstance(v, dict):
                raise ConfigError(f"`{key}` is a section; set its keys, e.g. `{key}.{fields(sub)[0].name}=...`; "
                                  f"got {v!r}.", title="invalid config value")
            kwargs[k] = _build_section(sub, v, key, engine_name, env_refs)
            continue
        if isinstance(v, dict) and not is_dataclass(known[k].type):
            raise ConfigError(f"`{key}` is a value, not a section; got {v!r}.", title="invalid config value")
        kwargs[k] = coerce_value(key, known[k], v, secret=_ref_text(env_refs.get(key)))
    return cls(**kwargs)


def _ref_text(ref: Any) -> str | None:
    if ref is None:
        return None
    return ref if isinstance(ref, str) else repr(ref)


def check_cross_field(cfg: RunConfig, *, check_environment: bool = True, trains: bool = True) -> None:
    """Rules that involve more than one key (and, with ``check_environment``, what the loggers
    need on this machine: their packages, WANDB_MODE, a project name they take). ``trains=False``:
    the training-only padding/token-budget rules are skipped (see build_run_config)."""
    if cfg.task.name in ("dataset", "jsonl", "parquet"):
        if not cfg.task.path:
            raise ConfigError(f"`task={cfg.task.name}` needs `task.path=` (a Parquet/JSONL/JSON/Arrow file, a "
                              f"save_to_disk directory, or a dataset name in the local Hugging Face cache).",
                              title="invalid config")
        if not cfg.task.reward_fn and not cfg.task.reward_fns and not cfg.task.reward_model.path \
                and not cfg.task.reward_url:  # a reward model or a remote scorer may score alone
            raise ConfigError("A dataset task needs a reward function: `task.reward_fn=mypkg.rewards:exact_match` "
                              "(a function (prompt, response, answer, **row) -> float; the current directory is "
                              "importable), a built-in such as `task.reward_fn=rl:math_boxed`, or several with "
                              "`'task.reward_fns=[mod:fmt,mod:acc]'`.", title="invalid config")
    if cfg.algorithm.ppo_mini_batch_size and cfg.data.train_batch_size % cfg.algorithm.ppo_mini_batch_size:
        raise ConfigError(
            f"`data.train_batch_size` ({cfg.data.train_batch_size}) must be a multiple of "
            f"`algorithm.ppo_mini_batch_size` ({cfg.algorithm.ppo_mini_batch_size}).", title="invalid config")
    if cfg.algorithm.clip_ratio_low >= 1.0:
        raise ConfigError("`algorithm.clip_ratio_low` must be < 1 (the lower clip bound is 1 - clip_ratio_low).",
                          title="invalid config value")
    from engine.config.policy_loss_rules import check_policy_loss

    check_policy_loss(cfg.algorithm)
    from engine.config.loggers import check_logger_options, check_loggers

    check_loggers(cfg.trainer.loggers, installed=check_environment)
    if check_environment:
        check_logger_options(cfg.trainer.loggers, cfg.trainer.project)
    check_tiny_model_dims(cfg)
    lora = cfg.model.lora
    if lora.rank and cfg.engine.name != "fsdp":
        raise ConfigError(f"LoRA (model.lora.rank={lora.rank}) runs on the FSDP engine only; use --engine fsdp or "
                          f"set model.lora.rank=0.", title="invalid config")
    t = cfg.trainer
    if t.ranks_per_node and not t.nnodes:
        raise ConfigError(f"`trainer.ranks_per_node={t.ranks_per_node}` needs `trainer.nnodes` (the number of nodes "
                          f"to spread over); set trainer.nnodes={max(1, t.nprocs // t.ranks_per_node)} or drop "
                          f"trainer.ranks_per_node.", title="invalid config")
    if t.nnodes and t.nnodes * (t.ranks_per_node or t.nprocs // t.nnodes) != t.nprocs:
        raise ConfigError(f"`trainer.nprocs` ({t.nprocs}) must equal trainer.nnodes ({t.nnodes}) x "
                          f"trainer.ranks_per_node ({t.ranks_per_node or 'nprocs / nnodes'}). Set trainer.nprocs="
                          f"{t.nnodes * max(1, t.ranks_per_node or t.nprocs // t.nnodes)} or change the node layout.",
                          title="invalid config")
    from engine.config.resolved import mini_batch_prompts, model_parallel_size

    e = cfg.engine
    mp = model_parallel_size(cfg)
    dp = max(1, t.nprocs // mp)
    prompts = mini_batch_prompts(cfg)  # per optimizer step
    if prompts * cfg.algorithm.rollout_n < dp:  # a rank with no sequence to train on: a traceback from it
        what = "algorithm.ppo_mini_batch_size" if cfg.algorithm.ppo_mini_batch_size else "data.train_batch_size"
        raise ConfigError(
            f"`{what}` x `algorithm.rollout_n` ({prompts} x {cfg.algorithm.rollout_n} = "
            f"{prompts * cfg.algorithm.rollout_n} sequences per optimizer step) is below the data-parallel ranks "
            f"({dp}: trainer.nprocs={t.nprocs}{f' / {mp} model-parallel' if mp > 1 else ''}): every rank trains on "
            f"its share of each update, so each needs at least one sequence. Raise {what} or "
            f"algorithm.rollout_n, or lower trainer.nprocs.", title="invalid config")
    a = cfg.algorithm
    if a.rollout_n == 1 and a.name in GROUP_BASELINE_ALGORITHMS:
        raise ConfigError(
            f"`algorithm.rollout_n=1` with algorithm={a.name}: {a.name}'s advantage compares each sample with the "
            f"other samples of its prompt, so a group of one has advantage 0 and nothing is learned. Sample "
            f"several responses per prompt (algorithm.rollout_n=8, the default), or use an estimator with another "
            f"baseline: algorithm=reinforce_pp (the batch) or algorithm=ppo (a critic).", title="invalid config")
    from engine.batching.validate import MULTI_TURN_LENGTH, SINGLE_TURN_LENGTH, validate_run_padding

    if trains:  # `rl eval` trains nothing: its sequences are checked against the model's positions instead
        validate_run_padding(cfg, longest=longest_sequence(cfg),
                             length_keys=MULTI_TURN_LENGTH if is_multi_turn(cfg) else SINGLE_TURN_LENGTH)
    if e.name == "megatron":
        if e.pipeline_model_parallel_size > 1 or e.context_parallel_size > 1:
            raise ConfigError(
                "The megatron backend runs data and tensor parallelism; pipeline and context parallelism "
                f"(engine.pipeline_model_parallel_size={e.pipeline_model_parallel_size}, "
                f"engine.context_parallel_size={e.context_parallel_size}) are not supported yet. Set both to 1 "
                "and use engine.tensor_model_parallel_size / more data-parallel ranks.", title="invalid config")
        mp = e.tensor_model_parallel_size * e.pipeline_model_parallel_size * e.context_parallel_size
        if cfg.trainer.nprocs % mp:
            raise ConfigError(
                f"`trainer.nprocs` ({cfg.trainer.nprocs}) must be a multiple of tensor x pipeline x context "
                f"parallel sizes ({mp}). Set trainer.nprocs={mp} or lower engine.tensor_model_parallel_size.",
                title="invalid config")
        if (cfg.trainer.nprocs // mp) % e.expert_model_parallel_size:
            raise ConfigError(
                f"`engine.expert_model_parallel_size={e.expert_model_parallel_size}` must divide the data-parallel "
                f"ranks (trainer.nprocs / tensor x pipeline x context = {cfg.trainer.nprocs // mp}): experts are split "
                f"over ranks of one data-parallel group. Set trainer.nprocs to a multiple of it, or lower it.",
                title="invalid config")
    if e.fp8 and e.name != "megatron":
        raise ConfigError(
            f"`engine.fp8=true` is not implemented for engine={e.name}: FP8 training runs through "
            f"Transformer-Engine layers, which only the megatron engine builds. Use `--engine megatron "
            f"engine.fp8=true` on an FP8-capable GPU, or drop engine.fp8.", title="invalid config value")
    if cfg.algorithm.router_replay != "off":
        if cfg.rollout.name != "torch":
            raise ConfigError(
                f"`algorithm.router_replay={cfg.algorithm.router_replay}` needs the rollout to record each "
                f"token's experts, which only rollout=torch does (rollout={cfg.rollout.name} does not return "
                f"routing). Use rollout=torch, or set algorithm.router_replay=off.", title="invalid config")
        if e.compile:
            raise ConfigError(
                f"`algorithm.router_replay={cfg.algorithm.router_replay}` with `engine.compile=true` is not "
                f"supported yet: the routers' record/replay hooks switch per forward, which a compiled graph "
                f"would not follow. Set engine.compile=false, or algorithm.router_replay=off.",
                title="invalid config")
    if is_multi_turn(cfg):  # multi-turn (engine/agents)
        what = "task.tools" if cfg.task.tools else "task.environment" if cfg.task.environment else "task=tool_add"
        if cfg.algorithm.router_replay != "off":
            raise ConfigError(f"`{what}` (multi-turn rollouts) with `algorithm.router_replay="
                              f"{cfg.algorithm.router_replay}` is not supported: tool tokens have no routing "
                              f"record. Set algorithm.router_replay=off.", title="invalid config")
    if cfg.trainer.stream_groups:
        from engine.config.async_rules import check_stream_groups

        check_stream_groups(cfg)
    if cfg.trainer.mode != "sync":
        from engine.config.async_rules import check_rollout_ahead, check_streamed

        check_rollout_ahead(cfg)
        if cfg.trainer.mode == "streamed":
            check_streamed(cfg)
    # whether this machine can run the config (CUDA, FP8 hardware) is checked where torch is
    # already loaded: engine.device.check_device_config, before a run starts


def check_tiny_model_dims(cfg: RunConfig) -> None:
    """The built-in tiny model's attention shape (model.path empty, model.preset=tiny): checked
    with the config, so `--dry-run` catches it, instead of a rank failing (an odd head size was a
    traceback from transformers' RoPE validation)."""
    m = cfg.model
    if m.path or m.preset != "tiny":
        return
    h, heads, kv = m.hidden_size, m.num_attention_heads, m.num_key_value_heads
    if h % heads or heads % kv or (h // heads) % 2:
        fit = 2 * heads * max(1, -(-h // (2 * heads)))  # the nearest hidden size at or above h that fits
        raise ConfigError(
            f"The tiny model's attention shape does not fit: model.hidden_size ({h}) must be a multiple of "
            f"model.num_attention_heads ({heads}) with an even head size (rotary embeddings rotate pairs; "
            f"{h} / {heads} is {h / heads:g}), and model.num_attention_heads must be a multiple of "
            f"model.num_key_value_heads ({kv}). E.g. model.hidden_size={fit}"
            + ("" if heads % kv == 0 else f" model.num_key_value_heads={_largest_divisor(heads, kv)}") + ".",
            title="invalid config value")


def _largest_divisor(n: int, below: int) -> int:
    """The largest divisor of ``n`` that is at most ``below``."""
    return max(d for d in range(1, min(n, below) + 1) if n % d == 0)
