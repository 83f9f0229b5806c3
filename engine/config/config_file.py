"""A config file given with `rl train --config FILE` (or `rl config show --config FILE`).

    f = read_config_file("runs/a/config.yaml")
    f.groups()   # {"engine": "megatron", "task": "add"}: the group options the file picks
    f.leaves()   # {"trainer.total_steps": 50, "optim.lr": "${oc.env:LR,1e-3}", ...} (unresolved)

The file is a mapping of sections, the layout of a run's own config.yaml (which it may be);
every key is optional (a partial file is merged over the defaults), a dotted key
(``trainer.total_steps: 5``) is the same as its nested form, and a group may be picked by its
option's name as on the command line (``task: add``). Interpolations stay unresolved
here: they resolve with the composed config, so ``${oc.env:...}`` and ``${trainer.seed}`` work.
Which option of a config group the file picks is read from the key that names it
(``engine.name``, ``task.name``, ``model.preset``, ...), so the group's own YAML applies under
the file's values, as `task=add` would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

# the key inside each config group's section that names the group's option
GROUP_NAME_KEYS = {"engine": "engine.name", "task": "task.name", "model": "model.preset",
                   "algorithm": "algorithm.name", "rollout": "rollout.name"}


@dataclass
class ConfigFile:
    path: str
    data: dict  # nested, interpolations unresolved

    def leaves(self) -> dict[str, Any]:
        """Flat ``section.key -> value``; a list is one value."""
        out: dict[str, Any] = {}
        stack: list[tuple[str, dict]] = [("", self.data)]
        while stack:
            prefix, d = stack.pop()
            for k, v in d.items():
                if isinstance(v, dict):  # an empty section sets nothing
                    stack.append((f"{prefix}{k}.", v))
                else:
                    out[f"{prefix}{k}"] = v
        return dict(sorted(out.items()))

    def groups(self) -> dict[str, str]:
        """group -> option, for each group whose naming key the file sets to a plain name."""
        from engine.config.load import group_options

        leaves = self.leaves()
        out = {}
        for group, key in GROUP_NAME_KEYS.items():
            value = leaves.get(key)
            if isinstance(value, str) and value in group_options(group):
                out[group] = value
        return out

    def error(self, e: ConfigError) -> ConfigError:
        """``e`` (about one of the file's keys) as one paragraph that names the file first."""
        return ConfigError(f"In --config {self.path}: {e.message}", title=e.title)


def read_config_file(path: str | Path) -> ConfigFile:
    """Read and shape-check ``path``: a readable YAML file holding a mapping. Any problem is one
    ConfigError naming the file (exit 2)."""
    from omegaconf import OmegaConf

    from engine import yaml_safe
    from engine.user_paths import file_kind, os_problem, shown, stat_path

    shown_path = shown(path)
    what = f"--config {shown_path}"
    st = stat_path(path, what, error=ConfigError, title="bad config file")
    if st is None:
        raise ConfigError(f"{what}: no such file. Give a YAML file of config keys (a run's own config.yaml "
                          f"works), e.g. `rl train --config runs/a/config.yaml`.", title="bad config file")
    import stat as stat_mod

    if not stat_mod.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} is {file_kind(st)}, not a YAML file. Give a file of config keys, e.g. a "
                          f"run's config.yaml.", title="bad config file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{what} {os_problem(e)}.", title="bad config file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} is not UTF-8 text; a config file is YAML.", title="bad config file") from None
    try:
        yaml_safe.check_bounded(text, what)
        top = _top_level_scalar(text)  # omegaconf reads a bare string as a key, and fails on a number
        node = OmegaConf.create(text) if top is None else None  # its YAML loader: `1e-3` a float, as on the command line
    except yaml_safe.YamlTooLarge as e:
        raise ConfigError(f"{e}.", title="bad config file") from None
    except Exception as e:  # a YAML syntax error, duplicate keys
        mark = getattr(e, "problem_mark", None)
        detail = (f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}" if mark is not None  # type: ignore[attr-defined]
                  else " ".join(str(e).split()))
        raise ConfigError(f"{what} is not valid YAML: {detail}", title="bad config file") from None
    data = top if top is not None else OmegaConf.to_container(node, resolve=False) if node is not None else {}
    if not isinstance(data, dict):
        kind = ("a list" if isinstance(data, list) else
                f"a true/false value ({str(data).lower()})" if isinstance(data, bool) else
                f"a number ({data!r})" if isinstance(data, (int, float)) else
                f"a string ({' '.join(str(data).split())[:60]!r})" if isinstance(data, str) else
                f"a {type(data).__name__}")
        raise ConfigError(f"{what} holds {kind}, not a mapping of config sections. Write it "
                          f"as a run's config.yaml is written: sections of keys, e.g. `trainer: {{total_steps: 50}}` "
                          f"(or one per line, indented).",
                          title="bad config file")
    if "defaults" in data:
        raise ConfigError(f"{what} has a Hydra `defaults` list, which rl's config files do not use. Choose a "
                          f"group's option by its name key (`task: {{name: add}}`, `engine: {{name: megatron}}`, "
                          f"`model: {{preset: smollm2-135m}}`) or on the command line (`task=add`).",
                          title="bad config file")
    return ConfigFile(str(path), _nest_dotted(_group_shorthand(data, what), what))


def _top_level_scalar(text: str):
    """The value of a YAML document that is one scalar (a string, a number, true/false); None for a
    mapping, a list or an empty document."""
    import yaml

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(root, yaml.ScalarNode) or root.tag == "tag:yaml.org,2002:null":
        return None
    return yaml.safe_load(text)


def _group_shorthand(data: dict, what: str) -> dict:
    """``task: add`` (a group's option by name, as on the command line) -> ``task: {name: add}``."""
    from engine.config.load import group_options
    from engine.config.validate import suggest_option

    out = dict(data)
    for group, key in GROUP_NAME_KEYS.items():
        value = out.get(group)
        if isinstance(value, str):
            options = group_options(group)
            if value not in options:
                hint = suggest_option(group, value, options)
                raise ConfigError(f"{what}: `{group}: {value}` is not a known {group} option.{hint} "
                                  f"Options: {', '.join(options)}.", title="unknown config option")
            out[group] = {key.split(".", 1)[1]: value}
    return out


def _nest_dotted(data: dict, what: str) -> dict:
    """``{"trainer.total_steps": 5}`` -> ``{"trainer": {"total_steps": 5}}`` (at any depth)."""
    out: dict = {}
    for k, v in data.items():
        if not isinstance(k, str):
            raise ConfigError(f"{what}: `{k!r}` is not a config key (keys are names like `trainer`).",
                              title="bad config file")
        parts = k.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{what} sets `{k}` and also gives `{p}` a value: write each key once.",
                                  title="bad config file")
        value = _nest_dotted(v, what) if isinstance(v, dict) else v
        last = parts[-1]
        if last in node and isinstance(node[last], dict) and isinstance(value, dict):
            node[last] = _merge(node[last], value, what, f"{k}.")
        elif last in node:
            raise ConfigError(f"{what} sets `{k}` twice (once dotted, once nested): write each key once.",
                              title="bad config file")
        else:
            node[last] = value
    return out


def _merge(a: dict, b: dict, what: str, prefix: str) -> dict:
    out = dict(a)
    for k, v in b.items():
        if k in out and isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = _merge(out[k], v, what, f"{prefix}{k}.")
        elif k in out:
            raise ConfigError(f"{what} sets `{prefix}{k}` twice (once dotted, once nested): write each key once.",
                              title="bad config file")
        else:
            out[k] = v
    return out
