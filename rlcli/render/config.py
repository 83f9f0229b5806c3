"""`rl config show` as YAML: the whole composed config, or (--diff-from-defaults) the keys that
differ, each with its default as a comment. Either text is a valid `--config` file."""

from __future__ import annotations


def scalar(value) -> str:
    """One YAML value on one line (flow style), quoted where YAML would misread it."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True)
    return text.strip().removesuffix("...").strip()


def config_yaml(view) -> str:
    import yaml

    header = ("# rl config: " + " ".join(f"{g}={o}" for g, o in view.groups.items())
              + (f"  (from --config {view.config_file})" if view.config_file else "")).replace("\n", " ")
    if not view.diff_only:
        body = yaml.safe_dump(view.shown(), sort_keys=False, default_flow_style=False, allow_unicode=True,
                              width=float("inf"))
        return f"{header}\n{body}"
    if not view.changed:
        return f"{header}\n# every key is at its default\n"
    lines = [header + "  (only keys that differ from the defaults)"]

    def walk(node: dict, depth: int, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key not in view.changed:
                lines.append(f"{'  ' * depth}{scalar(k)}:")
                walk(v, depth + 1, key + ".")
            else:
                lines.append(f"{'  ' * depth}{scalar(k)}: {scalar(v)}  # default: {scalar(view.changed[key][0])}")

    walk(view.shown(), 0, "")
    return "\n".join(lines) + "\n"
