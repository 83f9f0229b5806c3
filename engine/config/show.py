"""`rl config show`: the config `rl train` would run with, as data (the CLI renders it).

    view = show_config(["task=add"], config_file="exp.yaml", diff_from_defaults=True)
    view.shown()    # nested: every key, or only those that differ from the defaults
    view.changed    # key -> (default, now)

Values read from the environment (``${oc.env:NAME}``) are shown as their interpolation, never
the value (they may be secrets), as config.yaml saves them. What is shown is itself a valid
`--config` file: `rl config show ... > exp.yaml; rl train --config exp.yaml` runs that config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class ConfigView:
    config: dict            # nested, every key (environment values as their interpolation)
    groups: dict            # group -> option composed
    changed: dict           # key -> (default, now), now as `config` shows it
    config_file: str = ""   # --config FILE, if given
    diff_only: bool = False  # --diff-from-defaults

    def shown(self) -> dict:
        """The nested config to print: all of it, or (diff_only) the changed keys."""
        if not self.diff_only:
            return self.config
        return nest({k: now for k, (_default, now) in self.changed.items()})

    def to_json(self) -> dict:
        return {"config": self.shown(), "groups": self.groups,
                "changed": {k: {"default": d, "value": v} for k, (d, v) in self.changed.items()},
                "config_file": self.config_file or None, "diff_from_defaults": self.diff_only}


def nest(flat: dict) -> dict:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}`` (keys in the order given)."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def show_config(overrides: list[str] | None = None, engine: str | None = None,
                config_file: str | Path | None = None, diff_from_defaults: bool = False) -> ConfigView:
    """Compose exactly as `rl train` does (same checks, same errors) and return the result."""
    from engine.config.interpolation import keep_env_references
    from engine.config.load import load_run_config
    from engine.config.schema import CONFIG_GROUP_DEFAULTS

    loaded = load_run_config(list(overrides or []), engine=engine, config_file=config_file)
    config = keep_env_references(asdict(loaded.config), loaded.env_refs)
    changed = dict(loaded.changed)
    default_engine = CONFIG_GROUP_DEFAULTS["engine"]
    if loaded.config.engine.name != default_engine:
        # `changed` is measured against the chosen engine's defaults, where engine.name is never
        # a change; the diff still names the engine (it is a valid --config file only with it)
        changed["engine.name"] = (default_engine, loaded.config.engine.name)
    return ConfigView(config, dict(loaded.groups), dict(sorted(changed.items())), loaded.config_file,
                      diff_from_defaults)
