"""YAML from files others wrote (a run directory's config.yaml), read with bounded work.

YAML aliases are references: ten lines of ``&a [*b, *b, ...]`` describe billions of nodes
(the "billion laughs"). PyYAML builds them as shared references, cheaply, but every later walk
(OmegaConf, ``to_container``, a diff) expands them: `rl resume` of a run whose config.yaml held
one hung for ever. :func:`check_bounded` composes the document (no construction) and counts
its nodes as they expand, iteratively, refusing more than :data:`MAX_NODES` or nesting deeper
than :data:`MAX_DEPTH`; :func:`safe_load` then constructs it with ``yaml.safe_load``."""

from __future__ import annotations

from typing import Any

MAX_NODES = 1_000_000   # a config.yaml is a few hundred nodes
MAX_DEPTH = 100


class YamlTooLarge(ValueError):
    """The document expands past the limits (a ValueError: readers already handle bad YAML)."""


def check_bounded(text: str, source: str = "YAML") -> None:
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise YamlTooLarge(f"{source} is nested too deeply to parse") from None
    if root is None:
        return
    seen, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise YamlTooLarge(f"{source} expands to more than {MAX_NODES:,} nodes (aliases that multiply: "
                               f"a YAML bomb); refused unread")
        if depth > MAX_DEPTH:
            raise YamlTooLarge(f"{source} nests deeper than {MAX_DEPTH} levels; refused unread")
        if isinstance(node, yaml.SequenceNode):
            stack.extend((c, depth + 1) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))


def safe_load(text: str, source: str = "YAML") -> Any:
    import yaml

    check_bounded(text, source)
    return yaml.safe_load(text)
