"""Generate configs/rl.yaml, configs/engine/*.yaml and docs/config-reference.md from the
schema, so YAML and docs can never drift from the dataclasses.

    python -m engine.config.generate          # rewrite the files
    python -m engine.config.generate --check  # exit 1 if any file differs (CI drift check)
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

from engine.config.schema import CONFIG_GROUP_DEFAULTS, CONFIG_GROUPS, ENGINE_CONFIGS, nested_section, section_types

HEADER = "# GENERATED from engine/config/schema.py by `python -m engine.config.generate`. Do not edit.\n"


def _default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


YAML11_BOOLS = {"y", "n", "yes", "no", "on", "off", "true", "false"}


def _yaml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        if v.lower() in YAML11_BOOLS:  # unquoted, YAML reads these as booleans
            return f'"{v}"'
        return '""' if v == "" else (v if v.replace("_", "").replace("-", "").isalnum() else f'"{v}"')
    if isinstance(v, list):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    return repr(v) if isinstance(v, float) else str(v)


def _section_yaml(cls, indent: str) -> list[str]:
    lines = []
    for f in fields(cls):
        sub = nested_section(f)
        if sub is not None:  # a section inside a section (model.lora)
            lines.append(f"{indent}{f.name}:  # {f.metadata.get('help', '')}")
            lines += _section_yaml(sub, indent + "  ")
            continue
        lines.append(f"{indent}{f.name}: {_yaml_value(_default(f))}  # {f.metadata.get('help', '')}")
    return lines


def render_main() -> str:
    lines = [HEADER, "defaults:", "  - _self_"]
    lines += [f"  - {g}: {opt}" for g, opt in CONFIG_GROUP_DEFAULTS.items()]
    lines.append("")
    for section, cls in section_types().items():
        if section == "engine":
            continue
        lines.append(f"{section}:")
        lines += _section_yaml(cls, "  ")
        lines.append("")
    return "\n".join(lines)


def render_engine(name: str) -> str:
    cls = ENGINE_CONFIGS[name]
    lines = [HEADER, "# @package engine"]
    lines += _section_yaml(cls, "")
    return "\n".join(lines) + "\n"


def _leaves(cls, prefix: str):
    for f in fields(cls):
        sub = nested_section(f)
        if sub is not None:
            yield from _leaves(sub, f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}", f


def render_reference() -> str:
    out = ["# Config reference", "",
           "Generated from `engine/config/schema.py` (`python -m engine.config.generate`).",
           "Set any key on the command line: `rl train section.key=value`. Groups pick a preset file: "
           + ", ".join(f"`{g}=`" for g in CONFIG_GROUPS) + ".",
           "Start from a YAML file of keys with `rl train --config FILE` (a run's own config.yaml reproduces the run); "
           "`rl config show` prints the composed config (docs/config-files.md).",
           "A key marked *only with* is read by those options of its group alone (the schema's `only_for`); "
           "setting it while another option is chosen would do nothing, and is refused naming both "
           "(engine/config/owned_keys.py). The other engine's keys (its own table below) are refused the same way.",
           ""]
    from engine.config.owned_keys import owned_keys

    owned = owned_keys()
    for section, cls in section_types().items():
        classes = ENGINE_CONFIGS.values() if section == "engine" else [cls]
        for c in classes:
            title = f"`{section}`" + (f" ({c.__name__})" if section == "engine" else "")
            out += [f"## {title}", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
            for key, f in _leaves(c, section):
                m = f.metadata
                allowed = " / ".join(map(str, m["choices"])) if "choices" in m else ""
                if "min" in m or "max" in m:
                    allowed = f"{m.get('min', '')} .. {m.get('max', '')}"
                if "above" in m:
                    allowed = f"> {m['above']}" + (f" .. {m['max']}" if "max" in m else "")
                only = "; ".join(" or ".join(f"{g}={o}" for o in opts) for g, opts in owned.get(key, {}).items())
                meaning = m.get("help", "") + (f" *Only with {only}.*" if only else "")
                out.append(f"| `{key}` | `{_yaml_value(_default(f))}` | {allowed} | {meaning} |")
            out.append("")
    from engine.config.removed_keys import REMOVED_KEYS

    out += ["## Removed keys", "", "| key | use instead | why |", "|---|---|---|"]
    out += [f"| `{k.key}` | `{k.replacement}` | {k.reason} |" for k in REMOVED_KEYS.values()]
    from engine.config.foreign_keys import FOREIGN_KEYS

    out += ["", "## Coming from verl or TRL", "",
            "rl reads only its own keys. These verl config names and TRL `GRPOConfig` fields are refused with "
            "the rl key to set (a `--config` file using them gets every translation in one message; "
            "engine/config/foreign_keys.py). *value differs*: the value means something else in rl (see the note).",
            "", "| tool | their name | rl | note |", "|---|---|---|---|"]
    for name, k in FOREIGN_KEYS.items():
        rl = f"`{k.rl}`" + (" group" if k.rl and "." not in k.rl else "") if k.rl else "-"
        note = "; ".join(x for x in (k.note, "" if k.carries else "*value differs*") if x)
        out.append(f"| {k.tool} | `{name}` | {rl} | {note.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def generated_files(root: Path) -> dict[Path, str]:
    files = {root / "configs" / "rl.yaml": render_main(),
             root / "docs" / "config-reference.md": render_reference()}
    for name in ENGINE_CONFIGS:
        files[root / "configs" / "engine" / f"{name}.yaml"] = render_engine(name)
    return files


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    stale = []
    for path, text in generated_files(root).items():
        current = path.read_text() if path.exists() else None
        if current != text:
            stale.append(path)
            if "--check" not in argv:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if "--check" in argv and stale:
        print("stale generated files (run `python -m engine.config.generate`): " + ", ".join(map(str, stale)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
