"""What TAB offers for `rl`: config keys and values, config-group options, checkpoint paths.

Typer's completion scripts call back into `rl` on every TAB, so this module runs once per
keystroke. It imports only the standard library on the hot path: the key tree is built from
engine/config/schema.py (dataclasses only) and configs/**/*.yaml (PyYAML) once, stored as JSON
under ``$RL_CACHE_DIR/completion/`` (default ``~/.cache/rl/completion/``) and re-read on later
TABs. The cache file is named by a SHA-256 of the *contents* of schema.py, removed_keys.py,
this file and every configs YAML, so an edit to any of them picks a new file: it can never
serve stale keys. ``RL_COMPLETION_CACHE=0`` builds the tree every time instead (the bench
compares both).

Candidates follow Hydra's completion (``hydra/plugins/completion_plugin.py``):

    engine.pa      -> engine.param_offload=  engine.pad_to_length=  ...   (a leaf: ``key=``)
    trai           -> trainer.                                         (a node: ``key.``)
    ta             -> task.  task=                                     (a group: ``group=``)
    task=          -> task=add  task=arith  task=echo  ...             (configs/task/*.yaml)
    engine.fp8=    -> engine.fp8=false  engine.fp8=true                (the default first)

Defaults shown are the composed ones ``rl train`` would use: schema, then configs/rl.yaml,
then the chosen group files — groups and ``--engine`` already typed on the line are honoured
(``--engine megatron`` offers ``engine.tensor_model_parallel_size=``). Removed keys
(engine/config/removed_keys.py) are never offered. After `rl resume PATH`, only the keys
engine/checkpoint/resume_rules.py allows to change are offered, no groups, with the values
saved in that run's checkpoint (its manifest.json) and its engine's keys.

Shell quirks handled here, keyed on Typer's ``_RL_COMPLETE`` variable:
- bash splits words at ``=`` (COMP_WORDBREAKS), so after ``key=`` it completes only the value
  part; the key is recovered from ``COMP_WORDS``.
- bash and zsh append a space after a single match. A lone ``key=``, ``node.`` or ``dir/``
  match is therefore returned together with its continuations (``key=<default>``, the node's
  children, the directory's checkpoints), so the shell inserts the common prefix and no space.
"""

from __future__ import annotations

import os
from pathlib import Path

TREE_FORMAT = 2
CACHE_ENV = "RL_COMPLETION_CACHE"
KEEP_TREES = 8  # cached trees kept in the cache directory (one per version of the sources)
COMPLETE_ENV = "_RL_COMPLETE"
from engine.checkpoint.layout import MANIFEST, STEP_PREFIX  # noqa: E402  (the one layout; stdlib only)
from engine.checkpoint.layout import RUN_FILE as RUN_MARKER  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Where the sources are, and the cache keyed by their contents
# ---------------------------------------------------------------------------------------------

def _config_dir() -> Path:
    """The shipped configs/ directory (same answer as engine.config.load.config_dir)."""
    import configs

    return Path(configs.__file__).resolve().parent


def _engine_config_dir() -> Path:
    import engine.config  # an empty package __init__: no schema import here

    return Path(engine.config.__file__).resolve().parent


def source_files() -> list[Path]:
    """Every file the key tree is derived from; their contents name the cache file."""
    cfg = _config_dir()
    eng = _engine_config_dir()
    yamls = sorted(cfg.glob("*.yaml")) + sorted(cfg.glob("*/*.yaml"))
    rules = eng.parent / "checkpoint" / "resume_rules.py"
    extra = [rules] if rules.is_file() else []
    return [eng / "schema.py", eng / "removed_keys.py", Path(__file__).resolve()] + extra + yamls


def tree_digest() -> str:
    """SHA-256 over (relative name, contents) of every source file."""
    import hashlib

    cfg = _config_dir()
    h = hashlib.sha256(f"format={TREE_FORMAT}".encode())
    for p in source_files():
        name = str(p.relative_to(cfg)) if p.is_relative_to(cfg) else p.name
        h.update(b"\0" + name.encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    """``$RL_CACHE_DIR/completion`` or ``~/.cache/rl/completion`` (the rl cache root)."""
    root = os.environ.get("RL_CACHE_DIR") or os.path.join("~", ".cache", "rl")
    return Path(root).expanduser() / "completion"


def cache_path(digest: str | None = None) -> Path:
    return cache_dir() / f"keys-{(digest or tree_digest())[:20]}.json"


def key_tree() -> dict:
    """The key tree, from the content-keyed cache when it is enabled and present."""
    import json

    if os.environ.get(CACHE_ENV, "1") == "0":
        return build_key_tree()
    path = cache_path()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    tree = build_key_tree()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(tree, separators=(",", ":")))
        os.replace(tmp, path)
        # Keep the few newest trees (several installs of rl may share this directory).
        trees = sorted(path.parent.glob("keys-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in trees[KEEP_TREES:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # read-only home: completion still works, just builds every time
    return tree


# ---------------------------------------------------------------------------------------------
# Building the tree (cache miss only): schema + YAML
# ---------------------------------------------------------------------------------------------

def _render_default(value) -> str:
    """A Python default as the user would type it on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_render_default(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return "" if value is None else str(value)


def _render_node(node) -> str:
    """A YAML node's text exactly as written (``1e-08`` stays ``1e-08``, ``[0.9, 0.99]`` -> ``[0.9,0.99]``)."""
    import yaml

    if isinstance(node, yaml.ScalarNode):
        return node.value
    if isinstance(node, yaml.SequenceNode):
        return "[" + ",".join(_render_node(n) for n in node.value) + "]"
    return ""


def _flatten_yaml(node, prefix: str, out: dict[str, str]) -> None:
    import yaml

    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        if isinstance(value_node, yaml.MappingNode):
            _flatten_yaml(value_node, key + ".", out)
        else:
            out[key] = _render_node(value_node)


def _yaml_description(text: str) -> str:
    """The first comment line of a group file that says what the option is."""
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("#"):
            if s:
                break
            continue
        s = s.lstrip("#").strip()
        if s and not s.startswith("@package") and not s.startswith("GENERATED"):
            return s
    return ""


def build_key_tree() -> dict:
    """Walk the schema dataclasses and the configs YAML into a JSON-able tree.

    {"sections": {section: {field: {"type", "help", "choices"}}},   # engine excluded
     "engines": {engine_name: {field: {...}}},
     "base": {"trainer.total_steps": "40", ...},                      # schema <- rl.yaml
     "groups": {group: {option: {"help": str, "values": {key: text}}}},
     "group_defaults": {group: option},
     "removed": [dotted keys]}
    """
    from dataclasses import MISSING, fields

    import yaml

    from engine.config.removed_keys import REMOVED_KEYS
    from engine.config.schema import CONFIG_GROUP_DEFAULTS, CONFIG_GROUPS, ENGINE_CONFIGS, section_types

    removed = set(REMOVED_KEYS)

    from engine.config.schema import nested_section

    def describe(cls, section: str, prefix: str = "") -> tuple[dict, dict]:
        meta, defaults = {}, {}
        for f in fields(cls):
            key = f"{section}.{prefix}{f.name}"
            if key in removed:
                continue
            sub = nested_section(f)
            if sub is not None:  # model.lora.*: its leaves appear as fields "lora.rank", ...
                m, d = describe(sub, section, f"{prefix}{f.name}.")
                meta.update(m)
                defaults.update(d)
                continue
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            choices = list(f.metadata.get("choices", []))
            if kind == "bool" and not choices:
                choices = ["true", "false"]
            meta[prefix + f.name] = {"type": kind, "help": f.metadata.get("help", ""),
                            "choices": [_render_default(c) for c in choices]}
            if f.default is not MISSING:
                defaults[key] = _render_default(f.default)
            elif f.default_factory is not MISSING:  # type: ignore[misc]
                defaults[key] = _render_default(f.default_factory())  # type: ignore[misc]
        return meta, defaults

    sections: dict[str, dict] = {}
    base: dict[str, str] = {}
    for section, cls in section_types().items():
        if section == "engine":
            continue
        sections[section], d = describe(cls, section)
        base.update(d)
    engines: dict[str, dict] = {}
    engine_defaults: dict[str, dict] = {}
    for name, cls in ENGINE_CONFIGS.items():
        engines[name], engine_defaults[name] = describe(cls, "engine")

    cfg = _config_dir()
    main = yaml.compose((cfg / "rl.yaml").read_text())
    group_defaults = dict(CONFIG_GROUP_DEFAULTS)
    for key_node, value_node in (main.value if main is not None else []):
        if key_node.value == "defaults":
            for item in value_node.value:
                if isinstance(item, yaml.MappingNode):
                    for g, opt in item.value:
                        group_defaults[g.value] = opt.value
        elif isinstance(value_node, yaml.MappingNode):
            _flatten_yaml(value_node, key_node.value + ".", base)

    groups: dict[str, dict] = {}
    for group in CONFIG_GROUPS:
        groups[group] = {}
        for path in sorted((cfg / group).glob("*.yaml")):
            text = path.read_text()
            values: dict[str, str] = dict(engine_defaults.get(path.stem, {})) if group == "engine" else {}
            node = yaml.compose(text)
            if isinstance(node, yaml.MappingNode):  # a `# @package _global_` file sets keys of any section
                _flatten_yaml(node, "" if "@package _global_" in text.split("\n", 1)[0] else group + ".", values)
            groups[group][path.stem] = {"help": _yaml_description(text), "values": values}

    try:  # the keys `rl resume` lets change (engine/checkpoint/resume_rules.py)
        from engine.checkpoint.resume_rules import ALLOWED
        resume_allowed = sorted(ALLOWED)
    except ImportError:
        resume_allowed = None

    return {"format": TREE_FORMAT, "sections": sections, "engines": engines, "base": base,
            "groups": groups, "group_defaults": group_defaults, "removed": sorted(removed),
            "resume_allowed": resume_allowed}


# ---------------------------------------------------------------------------------------------
# The command line typed so far (Typer's completion protocol, read from the environment)
# ---------------------------------------------------------------------------------------------

def _shell() -> str:
    """'bash' | 'zsh' | 'fish' | 'powershell' | '' (not called from a shell)."""
    return os.environ.get(COMPLETE_ENV, "").removeprefix("complete_")


def _split(text: str) -> list[str]:
    import shlex

    try:
        return shlex.split(text)
    except ValueError:  # an open quote while typing
        return text.split()


def _typed_words() -> tuple[list[str], str | None]:
    """(words before the one being completed, with bash's ``k = v`` pieces re-joined;
    the bash key whose value is being completed, or None).

    bash: COMP_WORDS/COMP_CWORD, where ``task=ad`` arrives as ``task``, ``=``, ``ad``.
    zsh/fish/powershell: ``_TYPER_COMPLETE_ARGS`` holds the line up to the cursor.
    """
    if _shell() == "bash" and "COMP_WORDS" in os.environ:
        words = _split(os.environ["COMP_WORDS"])
        try:
            cword = int(os.environ.get("COMP_CWORD", len(words)))
        except ValueError:
            cword = len(words)
        current = words[cword] if cword < len(words) else ""
        before = words[1:cword]
        bash_key = None
        if current == "=" and before:
            bash_key, before = before[-1], before[:-1]
        elif len(before) >= 2 and before[-1] == "=":
            bash_key, before = before[-2], before[:-2]
        joined: list[str] = []
        i = 0
        while i < len(before):
            if i + 2 < len(before) and before[i + 1] == "=":
                joined.append(f"{before[i]}={before[i + 2]}")
                i += 3
            elif i + 1 < len(before) and before[i + 1] == "=":
                joined.append(f"{before[i]}=")
                i += 2
            else:
                joined.append(before[i])
                i += 1
        return joined, bash_key
    text = os.environ.get("_TYPER_COMPLETE_ARGS", "")
    words = _split(text)[1:]
    if words and not text.endswith(" "):
        words = words[:-1]
    return words, None


def _chosen_groups(words: list[str], tree: dict) -> dict[str, str]:
    """Group options already on the line (``task=add``, ``--engine megatron``, ``-e megatron``)."""
    chosen = dict(tree["group_defaults"])
    for i, w in enumerate(words):
        if w in ("--engine", "-e") and i + 1 < len(words):
            chosen["engine"] = words[i + 1]
        elif w.startswith("--engine="):
            chosen["engine"] = w.split("=", 1)[1]
        elif "=" in w:
            key, value = w.split("=", 1)
            if key in tree["groups"] and value in tree["groups"][key]:
                chosen[key] = value
    # --engine wins over engine=, as in engine.config.load.load_run_config
    for i, w in enumerate(words):
        if w in ("--engine", "-e") and i + 1 < len(words):
            chosen["engine"] = words[i + 1]
    if chosen.get("engine") not in tree["engines"]:
        chosen["engine"] = tree["group_defaults"].get("engine", "fsdp")
    return chosen


# ---------------------------------------------------------------------------------------------
# Key tree -> candidates
# ---------------------------------------------------------------------------------------------

def _subcommand(words: list[str]) -> tuple[str, list[str]]:
    """('train', [words after it]) from the words typed after `rl`."""
    for i, w in enumerate(words):
        if not w.startswith("-"):
            return w, words[i + 1:]
    return "", []


def _saved_run(path: str) -> tuple[str | None, dict[str, str]]:
    """(engine, flat config as typed text) of the checkpoint `rl resume PATH` would load:
    PATH/manifest.json, else the newest complete step_N's manifest, else run.json's engine."""
    import json

    root = os.path.expanduser(path.rstrip("/") or ".")
    manifest = os.path.join(root, MANIFEST)
    if not os.path.isfile(manifest):
        done = [s for s in _step_dirs(root) if s[2]]
        manifest = os.path.join(root, max(done)[1], MANIFEST) if done else ""
    engine, flat = None, {}
    try:
        data = json.loads(Path(manifest).read_text()) if manifest else {}
    except (OSError, ValueError):
        data = {}
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    stack = [("", config)]
    while stack:
        prefix, d = stack.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                stack.append((f"{prefix}{k}.", v))
            else:
                flat[f"{prefix}{k}"] = _render_default(v)
    engine = data.get("engine") or flat.get("engine.name")
    if not engine:
        try:
            engine = json.loads(Path(root, RUN_MARKER).read_text()).get("engine")
        except (OSError, ValueError, AttributeError):
            engine = None
    return engine, flat


def _on_line(words: list[str], group: str) -> bool:
    """Whether the line itself picks ``group`` (``task=add``; the engine also by --engine/-e)."""
    return any(w.startswith(f"{group}=") for w in words) or (
        group == "engine" and any(w in ("--engine", "-e") or w.startswith("--engine=") for w in words))


class _View:
    """The tree for one command line: every offerable leaf's metadata and current value.

    `rl train`: composed defaults for the groups on the line. `rl resume PATH`: the saved
    run's engine and values, only keys engine/checkpoint/resume_rules.py allows to change,
    and no groups (they cannot change on resume)."""

    def __init__(self, tree: dict, words: list[str]):
        command, rest = _subcommand(words)
        saved: dict[str, str] = {}
        chosen = _chosen_groups(words, tree)
        self.resume = command == "resume"
        if self.resume:
            path = next((w for w in rest if not w.startswith("-") and "=" not in w), "")
            engine, saved = _saved_run(path) if path else (None, {})
            if engine in tree["engines"]:
                chosen["engine"] = engine
        file_groups, file_values = ({}, {}) if self.resume else _config_file_values(words)
        for group, option in file_groups.items():  # the groups a --config file picks, unless the line does
            if option in tree["groups"].get(group, {}) and not _on_line(words, group):
                chosen[group] = option
        self.tree = tree
        self.chosen = chosen
        removed = set(tree["removed"])
        self.leaves: dict[str, dict] = {}
        for section, meta in tree["sections"].items():
            for name, m in meta.items():
                self.leaves[f"{section}.{name}"] = m
        for name, m in tree["engines"][chosen["engine"]].items():
            self.leaves[f"engine.{name}"] = m
        for key in removed:
            self.leaves.pop(key, None)
        self.defaults = dict(tree["base"])
        for group, option in chosen.items():
            self.defaults.update(tree["groups"].get(group, {}).get(option, {}).get("values", {}))
        self.defaults.update(file_values)  # `rl train --config FILE`: the file's values are the line's defaults
        if self.resume:
            self.defaults.update(saved)
            allowed = tree.get("resume_allowed")
            if allowed is not None:
                self.leaves = {k: m for k, m in self.leaves.items() if k in set(allowed)}
        self.eval = command == "eval"
        if self.eval:  # only what `rl eval` reads (engine/evaluate/config.py refuses the rest)
            from engine.evaluate.config import reads

            self.leaves = {k: m for k, m in self.leaves.items() if reads(k)}

    @property
    def groups(self) -> dict[str, dict]:
        if self.eval:
            from engine.evaluate.config import READ_GROUPS

            return {g: o for g, o in self.tree["groups"].items() if g in READ_GROUPS}
        return {} if self.resume else self.tree["groups"]

    def default(self, key: str) -> str:
        return self.defaults.get(key, "")


def engine_options() -> list[str]:
    """The training backends: configs/engine/*.yaml (``--engine`` values)."""
    return sorted(key_tree()["groups"].get("engine", {}))


def group_options(group: str) -> list[str]:
    """The options of a config group: configs/<group>/*.yaml."""
    return sorted(key_tree()["groups"].get(group, {}))


def _key_candidates(view: _View, incomplete: str) -> list[tuple[str, str]]:
    """``incomplete`` has no ``=``: next path segment of every matching key, plus groups."""
    parent = incomplete[: incomplete.rfind(".") + 1]
    out: dict[str, str] = {}
    for key, meta in view.leaves.items():
        if not key.startswith(incomplete):
            continue
        rest = key[len(parent):]
        seg, dot, _ = rest.partition(".")
        if dot:
            out.setdefault(f"{parent}{seg}.", f"{seg} settings")
        else:
            d = view.default(key)
            out[f"{key}="] = f"(default {d if d != '' else chr(39) * 2}) {meta['help']}"
    if not parent:
        for group, options in view.groups.items():
            if group.startswith(incomplete):
                out[f"{group}="] = f"(now {view.chosen.get(group)}) config group: {', '.join(sorted(options))}"
    return sorted(out.items())


def _value_candidates(view: _View, key: str, value_prefix: str) -> list[tuple[str, str]]:
    """After ``key=``: group options, or the leaf's default first, then its choices."""
    if key in view.groups:
        options = view.groups[key]
        return [(f"{key}={o}", ("(default) " if o == view.chosen.get(key) else "") + options[o]["help"])
                for o in sorted(options) if o.startswith(value_prefix)]
    meta = view.leaves.get(key)
    if meta is None:
        return []
    default = view.default(key)
    values: list[tuple[str, str]] = []
    if default != "":
        values.append((default, f"(default) {meta['help']}"))
    for c in meta["choices"]:
        if c != default:
            values.append((c, meta["help"]))
    return [(f"{key}={v}", h) for v, h in values if v.startswith(value_prefix)]


def _short(text: str, limit: int = 60) -> str:
    """Typer renders zsh/fish help through rich at 80 columns and a wrapped line becomes a
    bogus extra candidate in fish, so descriptions stay on one short line."""
    text = " ".join(text.split())
    text = text if len(text) <= limit else text[: limit - 3].rstrip() + "..."
    if _shell() in ("zsh", "fish", "powershell"):  # rich markup: `[true]` would vanish
        text = text.replace("[", "\\[")
    return text


def _override_items(incomplete: str) -> list[tuple[str, str]]:
    """Hydra-style (candidate, help) pairs for the whole override word ``incomplete``."""
    if incomplete[:1] in ("+", "~"):
        return []  # rl's schema is fixed: keys are never added or deleted
    words, _ = _typed_words()
    view = _View(key_tree(), words)
    if "=" in incomplete:
        key, value = incomplete.split("=", 1)
        return _value_candidates(view, key, value)
    items = _key_candidates(view, incomplete)
    if len(items) == 1 and _shell() in ("bash", "zsh"):
        # A single `node.` or `key=` match would get a trailing space from bash/zsh; add its
        # continuations so the shell inserts the common prefix instead and lists the rest.
        only = items[0][0]
        more = _key_candidates(view, only) if only.endswith(".") else _value_candidates(view, only[:-1], "")
        if only.endswith("=") and not more:
            more = [(f"{only}''", "empty string")]
        items = sorted(set(items) | set(more))
    return items


def complete_override(incomplete: str) -> list[tuple[str, str]]:
    """TAB on a `rl train` override: (candidate, help) pairs, Hydra-style.

    ``engine.pa`` -> ``engine.param_offload=`` ...; ``trainer`` -> ``trainer.``;
    ``task=`` -> ``task=add`` ...; ``engine.fp8=`` -> ``engine.fp8=false`` (default first),
    ``engine.fp8=true``. Under bash the part after ``=`` is completed on its own (bash treats
    ``=`` as a word break), so there the candidates are the bare values.
    """
    try:
        if _shell() == "bash":
            _, bash_key = _typed_words()
            if bash_key is not None:
                value = "" if incomplete == "=" else incomplete
                if bash_key.startswith("-"):  # `--engine=me`: Click took `=` for the option's value
                    if bash_key not in ("--engine", "-e"):
                        return []
                    return [e for e in engine_options() if e.startswith(value)]
                strip = len(bash_key) + 1
                return [(c[strip:], _short(h)) for c, h in _override_items(f"{bash_key}={value}")]
        return [(c, _short(h)) for c, h in _override_items(incomplete)]
    except Exception:  # never print a traceback into someone's prompt
        return []


# ---------------------------------------------------------------------------------------------
# Checkpoint paths
# ---------------------------------------------------------------------------------------------

def _step_dirs(path: str) -> list[tuple[int, str, bool]]:
    """(step, name, complete) for every step_N directory in ``path``."""
    out = []
    try:
        with os.scandir(path) as it:
            for e in it:
                n = e.name
                if n.startswith(STEP_PREFIX) and n[len(STEP_PREFIX):].isdigit() and e.is_dir():
                    out.append((int(n[len(STEP_PREFIX):]), n, os.path.isfile(os.path.join(path, n, MANIFEST))))
    except OSError:
        pass
    return out


def _is_run_root(path: str) -> bool:
    return os.path.isfile(os.path.join(path, RUN_MARKER)) or bool(_step_dirs(path))


def _path_items(incomplete: str, files: bool) -> list[tuple[str, str]]:
    head, prefix = incomplete[: incomplete.rfind("/") + 1], incomplete[incomplete.rfind("/") + 1:]
    where = os.path.expanduser(head) if head else "."
    steps, runs, dirs, plain = [], [], [], []
    in_run_root = _is_run_root(where)
    if in_run_root:
        for step, name, complete in sorted(_step_dirs(where), key=lambda s: (not s[2], -s[0])):
            if name.startswith(prefix):
                steps.append((f"{head}{name}", f"step {step}, " + (
                    "complete" if complete else "INCOMPLETE (no manifest.json; rl resume skips it)")))
    try:
        entries = sorted(os.scandir(where), key=lambda e: e.name)
    except OSError:
        entries = []
    for e in entries:
        name = e.name
        if not name.startswith(prefix) or (name.startswith(".") and not prefix.startswith(".")):
            continue
        if in_run_root and name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
            continue  # already listed above, in checkpoint order
        full = os.path.join(where, name)
        if e.is_dir():
            if _is_run_root(full):
                done = [s for s in _step_dirs(full) if s[2]]
                latest = max(done)[0] if done else None
                runs.append((f"{head}{name}/", f"run, latest complete step {latest}" if latest is not None
                             else "run, no complete checkpoint yet"))
            else:
                dirs.append((f"{head}{name}/", "directory"))
        elif files:
            plain.append((f"{head}{name}", "file"))
    return steps + runs + dirs + plain


def _path_candidates(incomplete: str, files: bool) -> list[tuple[str, str]]:
    items = _path_items(incomplete, files)
    if len(items) == 1 and items[0][0].endswith("/") and _shell() in ("bash", "zsh"):
        items = items + _path_items(items[0][0], files)  # no trailing space after `dir/`
    return [(c, _short(h)) for c, h in items]


def complete_ckpt_path(incomplete: str) -> list[str]:
    """TAB on `rl resume PATH`: step_N dirs of a run root (complete ones first, newest first),
    then run roots (``ckpt/``), then other directories to descend into."""
    try:
        return [c for c, _ in _path_candidates(incomplete, files=False)]
    except Exception:
        return []


def complete_ckpt_path_described(incomplete: str) -> list[tuple[str, str]]:
    """Like complete_ckpt_path, with a description per candidate (zsh and fish show it:
    "step 40, complete", "run, latest complete step 40", "INCOMPLETE ...")."""
    try:
        return _path_candidates(incomplete, files=False)
    except Exception:
        return []


def complete_config_file(incomplete: str) -> list[tuple[str, str]]:
    """TAB on `--config FILE`: YAML files (in a run root its config.yaml, which reproduces the
    run), run roots and other directories to descend into; no step_N dirs."""
    try:
        head = incomplete[: incomplete.rfind("/") + 1]
        in_run = _is_run_root(os.path.expanduser(head) if head else ".")
        out = []
        for c, h in _path_candidates(incomplete, files=True):
            if c.endswith("/"):
                out.append((c, h))
            elif c.endswith((".yaml", ".yml")) and not h.startswith("step "):
                run_config = in_run and c.rsplit("/", 1)[-1] == "config.yaml"
                out.append((c, "the run's config (reproduces the run)" if run_config else "YAML file"))
        return out
    except Exception:
        return []


def _config_file_values(words: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(groups, flat values as typed text) of the `--config FILE` on the line, if any."""
    path = ""
    for i, w in enumerate(words):
        if w in ("--config", "-c") and i + 1 < len(words):
            path = words[i + 1]
        elif w.startswith("--config="):
            path = w.split("=", 1)[1]
    if not path:
        return {}, {}
    from engine import yaml_safe

    try:
        data = yaml_safe.safe_load(Path(os.path.expanduser(path)).read_text(), path)
    except Exception:
        return {}, {}
    flat: dict[str, str] = {}
    stack = [("", data if isinstance(data, dict) else {})]
    while stack:
        prefix, d = stack.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                stack.append((f"{prefix}{k}.", v))
            else:
                flat[f"{prefix}{k}"] = _render_default(v)
    names = {"engine": "engine.name", "task": "task.name", "model": "model.preset", "algorithm": "algorithm.name",
             "rollout": "rollout.name"}
    groups = {g: flat.get(k) or (_render_default(data[g]) if isinstance(data, dict) and isinstance(data.get(g), str)
                                 else "") for g, k in names.items()}
    return {g: v for g, v in groups.items() if v}, flat


def complete_inspect_path(incomplete: str) -> list[tuple[str, str]]:
    """TAB on `rl inspect-ckpt PATH`: as complete_ckpt_path_described, plus plain files
    (model.safetensors, a torch.save file) since inspect-ckpt reads those too."""
    try:
        return _path_candidates(incomplete, files=True)
    except Exception:
        return []


# ---------------------------------------------------------------------------------------------
# Start-up: what Typer itself costs on every TAB
# ---------------------------------------------------------------------------------------------

_MARKUP_TAG = None


def _plain_help(text: str) -> str:
    """Rich markup -> plain text, one line, without importing rich (``[bold]x[/]`` -> ``x``,
    ``\\[`` -> ``[``)."""
    global _MARKUP_TAG
    import re

    if _MARKUP_TAG is None:
        _MARKUP_TAG = re.compile(r"(?<!\\)\[/?[a-z#@/][^\[\]]*\]")
    return " ".join(_MARKUP_TAG.sub("", text).replace("\\[", "[").split())


def speed_up_completion() -> list[str]:
    """Remove the two costs Typer adds to every TAB; returns what was patched.

    Call it first thing in ``main()``. It does nothing unless ``_RL_COMPLETE`` asks for a
    completion (``complete_bash``/``complete_zsh``/``complete_fish``...), so real commands,
    ``--help`` and ``--show-completion`` run stock Typer.

    1. To find the parameter being completed, Click parses the line "resiliently" and runs
       every parameter's ``process_value``; Typer >= 0.2x coerces each value there through a
       pydantic TypeAdapter, so each TAB imports pydantic and builds adapters. Completion
       never uses coerced values: under resilient parsing the raw strings are kept.
    2. zsh and fish show descriptions, which Typer renders through ``rich`` (importing it,
       and wrapping at 80 columns, which splits one fish candidate into two). Descriptions
       are flattened to one plain line instead.

    Both patch Typer internals (``typer.core._TyperParameter.process_value``,
    ``typer._completion_classes._sanitize_help_text``); each is skipped if that name is
    absent, and tests/test_completion.py drives real shells through the patched path.
    """
    if not os.environ.get(COMPLETE_ENV, "").startswith("complete_"):
        return []
    done = []
    try:
        from typer.core import _TyperParameter
    except ImportError:
        _TyperParameter = None
    original = _TyperParameter.__dict__.get("process_value") if _TyperParameter else None
    if original is not None and not getattr(original, "_rl_completion_patch", False):
        def process_value(self, ctx, value):
            if ctx.resilient_parsing:
                return value
            return original(self, ctx, value)

        process_value._rl_completion_patch = True  # type: ignore[attr-defined]
        _TyperParameter.process_value = process_value  # type: ignore[method-assign]
        done.append("process_value")
    try:
        import typer._completion_classes as classes
    except ImportError:
        classes = None
    if classes is not None and hasattr(classes, "_sanitize_help_text"):
        classes._sanitize_help_text = _plain_help
        done.append("_sanitize_help_text")
    return done
