"""Compose a RunConfig from configs/ (Hydra compose API) and command-line overrides.

    cfg, info = load_run_config(["trainer.total_steps=50"], engine="megatron")

Overrides are checked against the schema *before* Hydra sees them, so a typo gets "did you
mean", a removed key names its replacement, and a bad group option lists the options —
instead of Hydra's "Key 'x' is not in struct".

    cfg, info = load_run_config(["optim.lr=1e-3"], config_file="runs/a/config.yaml")

A config file (`--config FILE`, engine/config/config_file.py) sits between the defaults and the
command line: the groups it picks are composed, its values set over them, and then every
command-line override wins over both. A run's own config.yaml composes to exactly that run's
config.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config.owned_keys import check_overrides_take_effect
from engine.config.schema import BUILTIN_TASKS, CONFIG_GROUP_DEFAULTS, CONFIG_GROUPS, RunConfig
from engine.config.validate import build_run_config, check_key, suggest, suggest_option
from engine.errors import ConfigError

CONFIG_NAME = "rl"


def config_dir() -> Path:
    """The shipped configs/ directory (works for editable and regular installs)."""
    import configs

    return Path(configs.__file__).resolve().parent


def group_options(group: str) -> list[str]:
    d = config_dir() / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


@dataclass
class LoadedConfig:
    config: RunConfig
    overrides: list[str]
    groups: dict[str, str]
    changed: dict[str, tuple] = field(default_factory=dict)  # key -> (default, now)
    env_refs: dict[str, object] = field(default_factory=dict)  # key -> `${oc.env:...}` text (never saved resolved)
    config_file: str = ""  # --config FILE, when one was given


def parse_override(text: str) -> tuple[str, str, str]:
    """'a.b=1' -> ('', 'a.b', '1'); '+a=1' -> ('+', 'a', '1'); '~a' -> ('~', 'a', '')."""
    prefix = ""
    if text.startswith("++"):
        prefix, text = "++", text[2:]
    elif text[:1] and text[0] in "+~":
        prefix, text = text[0], text[1:]
    if "=" not in text:
        if prefix == "~" and text.strip():
            return prefix, text.strip(), ""
        raise ConfigError(
            f"`{text}` is not an override. Overrides look like `key=value`, e.g. trainer.total_steps=50 "
            f"or task=add.", title="invalid override")
    key, value = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"`{text}` has no key before `=`. Overrides look like `key=value`, e.g. "
                          f"trainer.total_steps=50.", title="invalid override")
    return prefix, key.strip(), value


def precheck_overrides(overrides: list[str], engine: str | None) -> str:
    """Validate override keys and group choices against the schema; returns the engine name."""
    groups = {}
    for o in overrides:
        prefix, key, value = parse_override(o)
        if key in CONFIG_GROUPS:
            groups[key] = value
    engine_name = engine or groups.get("engine") or "fsdp"
    for o in overrides:
        prefix, key, value = parse_override(o)
        if prefix in ("~", "++", "+"):
            raise ConfigError(
                f"`{o}`: rl's config has a fixed schema, so keys cannot be added or deleted with "
                f"`{prefix}`. Set the key directly: `{key}=<value>`.", title="invalid override")
        if key in CONFIG_GROUPS:
            opts = group_options(key)
            if value not in opts:
                raise ConfigError(
                    f"`{key}={value}` is not a known {key} option.{suggest_option(key, value, opts)} "
                    f"Options: {', '.join(opts)}.", title="unknown config option")
            continue
        check_key(key, engine_name, value)
        check_not_a_sweep(o, key, value)
        if key == "engine.name" and value.strip() != engine_name:
            # setting the name alone kept the other engine's keys, and the error named one of them
            # (`engine.reshard_after_forward` belongs to another engine), not the override given
            opts = group_options("engine")
            fix = f"`--engine {value.strip()}` (or `engine={value.strip()}`)" if value.strip() in opts else \
                f"`--engine <name>` with one of: {', '.join(opts)}"
            raise ConfigError(f"`{o}`: the engine is a config group, chosen with {fix}, which also picks that "
                              f"engine's keys. Drop `engine.name=`.", title="invalid override")
    return engine_name


def check_not_a_sweep(override: str, key: str, value: str) -> None:
    """Hydra's sweep syntax (``a,b``, ``range()``, ``choice()``, ``glob()``) asks for several runs,
    which Hydra's answer ("add --multirun") does not give here: say what rl does instead."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        sweep = OverridesParser.create().parse_overrides([override])[0].is_sweep_override()
    except Exception:  # a syntax error: Hydra's own message, at compose time, says where
        return
    if sweep:
        raise ConfigError(
            f"`{override}` is a Hydra sweep (one run per value), and `rl train` runs one job: start one run per "
            f"value, each with its own checkpoint.dir (e.g. `for v in ...; do rl train {key}=$v "
            f"checkpoint.dir=ckpt-$v; done`). A list value is written `{key}=[a,b]`; a string with a comma is "
            f"quoted: `{key}='{value}'`.", title="invalid override")


def compose_dict(overrides: list[str], with_env_refs: bool = False, file_values: dict | None = None,
                 file_path: str = ""):
    """Hydra compose over configs/ -> plain dict with interpolations resolved (no validation).
    ``with_env_refs``: also return the keys whose values read the environment (see
    engine.config.interpolation). ``file_values``: flat key -> value from a config file, set
    after composition (interpolations unresolved, so they resolve with the whole config); the
    caller leaves out the keys a command-line override sets."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from engine.config.interpolation import env_references, resolve_container

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = compose(config_name=CONFIG_NAME, overrides=overrides)
    except Exception as e:  # Hydra's own errors (bad value syntax, etc.)
        text = " ".join(str(e).split())
        hint = ""
        if any(k in text for k in ("LexerNoViableAlt", "no viable alternative", "extraneous input", "mismatched input")):
            hint = ("" if text.endswith(".") else ".") + (" A value holding characters the override grammar reads itself (~ [ ] { } , = $ quotes) must be "
                    "quoted, e.g. 'checkpoint.dir=\"~/runs/a\"' (the outer quotes for the shell).")
        raise ConfigError(f"Could not apply the overrides {' '.join(overrides)}: {text}{hint}",
                          title="invalid override") from None
    finally:
        GlobalHydra.instance().clear()
    for key, value in (file_values or {}).items():
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except Exception as e:
            raise ConfigError(f"In --config {file_path}: `{key}` cannot be set to {value!r}: "
                              f"{' '.join(str(e).split()) or type(e).__name__}.", title="invalid config value") from None
    data = resolve_container(cfg)
    if with_env_refs:
        return data, env_references(OmegaConf.to_container(cfg, resolve=False))  # type: ignore[arg-type]
    return data


def check_group_choices(overrides: list[str], engine: str | None = None, file_groups: dict | None = None,
                        file_path: str = "") -> None:
    """A config group chosen twice with different values is an error naming both (Hydra would
    keep one silently: `--engine fsdp engine=megatron` ran fsdp, and overrides.yaml recorded one).
    ``file_groups``: the options a --config file picks (engine/config/config_file.py)."""
    from engine.config.config_file import GROUP_NAME_KEYS

    seen: dict[str, tuple[str, str]] = {}  # group -> (value, as the user wrote it)
    for group, value in (file_groups or {}).items():
        seen[group] = (value, f"{GROUP_NAME_KEYS[group]}: {value}` in `--config {file_path}")
    if engine is not None and "engine" in seen and seen["engine"][0] != engine:
        raise ConfigError(f"`{seen['engine'][1]}` and `--engine {engine}` both choose the engine, and differ. Keep "
                          f"the one you mean and drop the other.", title="conflicting overrides")
    if engine is not None:
        seen["engine"] = (engine, f"--engine {engine}")
    for o in overrides:
        _prefix, key, value = parse_override(o)
        if key not in CONFIG_GROUPS:
            continue
        value = value.strip()
        if key in seen and seen[key][0] != value:
            raise ConfigError(f"`{seen[key][1]}` and `{o}` both choose the {key}, and differ. Keep the one you "
                              f"mean and drop the other.", title="conflicting overrides")
        seen.setdefault(key, (value, o))


def check_task_keys(cfg: RunConfig, overrides: list[str]) -> None:
    """Dataset keys given to a built-in task are an error: the built-in tasks generate their prompts,
    so `task.path=prompts.jsonl` without `task=dataset` (or jsonl/parquet) trained the built-in task
    and ignored the file."""
    if cfg.task.name not in BUILTIN_TASKS:
        return
    given = [o for o in overrides if parse_override(o)[1] in DATASET_ONLY_TASK_KEYS]
    if given:
        raise ConfigError(f"`{given[0]}` is a dataset key, but the task is the built-in `{cfg.task.name}`, which "
                          f"generates its own prompts and would ignore it. For your own data add `task=dataset` "
                          f"(or task=jsonl / task=parquet); for the built-in task drop `{given[0].split('=')[0]}`.",
                          title="conflicting overrides")


# task keys that only a dataset task reads (a built-in task generates its prompts)
DATASET_ONLY_TASK_KEYS = ("task.path", "task.format", "task.subset", "task.split", "task.val_split",
                          "task.prompt_key", "task.answer_key")


def load_run_config(overrides: list[str] | None = None, engine: str | None = None,
                    config_file: str | Path | None = None) -> LoadedConfig:
    """The run's config: configs/ defaults, then ``config_file`` (if any), then ``overrides``."""
    overrides = list(overrides or [])
    cfile = None
    if config_file is not None:
        from engine.config.config_file import read_config_file

        cfile = read_config_file(config_file)
    file_groups = cfile.groups() if cfile is not None else {}
    check_group_choices(overrides, engine, file_groups, cfile.path if cfile is not None else "")
    if engine is not None:
        if engine not in group_options("engine"):
            opts = group_options("engine")
            raise ConfigError(f"`--engine {engine}` is not a known engine.{suggest(engine, opts)} "
                              f"Options: {', '.join(opts)}.", title="unknown engine")
        overrides = [o for o in overrides if not o.startswith("engine=")] + [f"engine={engine}"]
    engine_name = precheck_overrides(overrides, engine or file_groups.get("engine"))
    file_values: dict = {}
    if cfile is not None:
        on_line = {parse_override(o)[1] for o in overrides}
        overrides = [f"{g}={v}" for g, v in file_groups.items() if g not in on_line] + overrides
        file_values = _file_values(cfile, engine_name, on_line - set(CONFIG_GROUPS))
    try:
        data, env_refs = compose_dict(overrides, with_env_refs=True, file_values=file_values,
                                      file_path=cfile.path if cfile is not None else "")
        cfg = build_run_config(data, env_refs=env_refs)
    except ConfigError as e:
        raise _from_file(e, cfile, file_values) from None
    check_task_keys(cfg, overrides)
    check_overrides_take_effect(cfg, [o for o in overrides if parse_override(o)[1] not in CONFIG_GROUPS])
    groups = {g: _chosen(overrides, g) for g in CONFIG_GROUPS}
    defaults = _defaults(groups["engine"])
    if cfile is not None:
        _check_file_task_keys(cfg, cfile, file_values, defaults)
        _check_file_keys_take_effect(cfg, cfile, file_values, groups)
    changed = {k: (a, env_refs[k] if k in env_refs else b) for k, (a, b) in diff_configs(defaults, cfg).items()}
    return LoadedConfig(cfg, overrides, groups, changed, env_refs, cfile.path if cfile is not None else "")


def _file_values(cfile, engine_name: str, on_line: set[str]) -> dict:
    """The file's flat values that apply: every key checked against the schema (an unknown,
    removed or other-engine key is the error an override gets, naming the file), less those
    a command-line override sets (the command line wins)."""
    from engine.config.foreign_keys import foreign_config_message

    translated = foreign_config_message(cfile.data)  # a verl (or TRL) config: every name it uses at once
    if translated:
        raise cfile.error(ConfigError(translated, title="unknown config keys"))
    out = {}
    for key, value in cfile.leaves().items():
        try:
            check_key(key, engine_name)
        except ConfigError as e:
            raise cfile.error(e) from None
        if any(key == k or key.startswith(k + ".") for k in on_line):
            continue
        out[key] = value
    if out.get("checkpoint.overwrite") is True:
        # a run's config.yaml records overwrite=true when that run replaced another: taken from
        # the file, rerunning it would delete the run it came from. Deleting is asked on the line.
        raise ConfigError(
            f"--config {cfile.path} sets checkpoint.overwrite=true, which deletes every file of the run in "
            f"checkpoint.dir={out.get('checkpoint.dir', '<default>')} before starting. A file cannot ask for that: "
            f"give checkpoint.overwrite=true on the command line to replace that run, or checkpoint.overwrite=false "
            f"(with checkpoint.dir=<new dir> for a rerun beside it).", title="config file would delete a run")
    return out


def _from_file(e: ConfigError, cfile, file_values: dict) -> ConfigError:
    """A validation error about a key the file set: say so (it names the key first, `key` ...)."""
    import re

    m = re.match(r"`([^`=]+)`", e.message)
    if cfile is None or not m or e.message.startswith("In --config"):
        return e
    key = m.group(1)
    if any(k == key or k.startswith(key + ".") for k in file_values):
        return cfile.error(e)
    return e


def _check_file_task_keys(cfg: RunConfig, cfile, file_values: dict, defaults: RunConfig) -> None:
    """A dataset key the file sets (away from its default) on a built-in task: the error an
    override gets (check_task_keys), naming the file. A run's config.yaml holds every key at
    its default, which is no conflict."""
    flat_defaults = flatten(asdict(defaults))
    given = [f"{k}={v}" for k, v in file_values.items()
             if k in DATASET_ONLY_TASK_KEYS and v != flat_defaults.get(k)]
    try:
        check_task_keys(cfg, given)
    except ConfigError as e:
        raise cfile.error(e) from None


def _check_file_keys_take_effect(cfg: RunConfig, cfile, file_values: dict, groups: dict[str, str]) -> None:
    """A key the file sets away from what its groups give, which the chosen engine, rollout or
    algorithm ignores: the error an override gets, naming the file. A run's config.yaml holds
    every key, at the values its groups give where the run did not read them: no conflict."""
    given = flatten(asdict(_group_defaults(tuple(sorted(groups.items())))))
    try:
        check_overrides_take_effect(cfg, [f"{k}={v}" for k, v in file_values.items() if v != given.get(k)])
    except ConfigError as e:
        raise cfile.error(e) from None


@functools.lru_cache(maxsize=None)
def _group_defaults(groups: tuple[tuple[str, str], ...]) -> RunConfig:
    """The config the chosen group options give with no key set."""
    return build_run_config(compose_dict([f"{g}={v}" for g, v in groups]), check_environment=False)


def _defaults(engine_name: str) -> RunConfig:
    """The config with no overrides but the engine (what `changed` is measured against)."""
    return copy.deepcopy(_defaults_cached(engine_name))


@functools.lru_cache(maxsize=None)
def _defaults_cached(engine_name: str) -> RunConfig:
    return build_run_config(compose_dict([f"engine={engine_name}"]))


def _chosen(overrides: list[str], group: str) -> str:
    default = CONFIG_GROUP_DEFAULTS[group]
    for o in overrides:
        if o.startswith(f"{group}="):
            default = o.split("=", 1)[1]
    return default


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def diff_configs(a: RunConfig, b: RunConfig) -> dict[str, tuple]:
    fa, fb = flatten(asdict(a)), flatten(asdict(b))
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def config_from_dict(data: dict) -> RunConfig:
    """Rebuild a RunConfig from a saved dict, e.g. a checkpoint's config. Values saved as
    `${oc.env:NAME}` (secrets are never saved resolved) are read from the environment now.
    The loggers' packages and settings are not checked: a saved config is read here, not run (a
    run resumed on a machine without wandb may drop it with trainer.loggers=...; apply_overrides_to
    checks the config that runs)."""
    from engine.config.interpolation import create_resolved, env_references

    return build_run_config(create_resolved(data), check_environment=False, env_refs=env_references(data))


def apply_overrides_to(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply key=value overrides to an existing config (used by `rl resume`)."""
    from omegaconf import OmegaConf

    engine_name = cfg.engine.name
    base = OmegaConf.create(asdict(cfg))
    for o in overrides:
        prefix, key, value = parse_override(o)
        if prefix:
            raise ConfigError(f"`{o}`: only plain `key=value` overrides are allowed here.", title="invalid override")
        if key in CONFIG_GROUPS:
            raise ConfigError(f"`{o}`: config groups cannot change on resume; set individual keys instead.",
                              title="invalid override")
        check_key(key, engine_name)
        try:
            OmegaConf.update(base, key, _parse_value(value), merge=False)
        except Exception as e:  # a malformed interpolation, a value omegaconf cannot hold
            from engine.config.interpolation import interpolation_error

            raise interpolation_error(e) from None
    from engine.config.interpolation import env_references, resolve_container

    refs = env_references(OmegaConf.to_container(base, resolve=False))  # type: ignore[arg-type]
    out = build_run_config(resolve_container(base), env_refs=refs)
    check_overrides_take_effect(out, overrides)
    return out


def _parse_value(text: str):
    import re

    import yaml

    try:
        v = yaml.safe_load(text) if text != "" else ""
    except Exception:
        return text
    if isinstance(v, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", v):
        return float(v)  # YAML 1.1 reads 1e-3 as a string
    return v


os.environ.setdefault("HYDRA_FULL_ERROR", "0")
