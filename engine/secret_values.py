"""Values read from the environment are secrets: no message shows them.

    remember_env_values({"trainer": {"project": "${oc.env:WANDB_PROJECT}"}})  # before resolving
    redact("project hunter2 not found")   # -> "project ${oc.env:WANDB_PROJECT} not found"

A config value written ``${oc.env:NAME}`` (or ``${env:NAME}``) is read from the environment when
the config resolves; config.yaml, checkpoint manifests and the dry run's config keep the
interpolation text (engine/config/interpolation.py). Everything else that reaches the user (the
message of every UserError, what rlcli prints on error, the preflight table, JSON output) goes
through ``redact``: each environment value seen while resolving is replaced by its
interpolation text, the way CI systems mask their secrets in logs. The messages of config
validation do not format such values in the first place (engine/config/validate.py); this is
the net under every other message.

A value of six characters or more is replaced wherever it occurs; a shorter one only where it
stands alone (not inside a longer word or number), so a variable holding `3` does not rewrite
every 3 of a message.
"""

from __future__ import annotations

import os
import re
from typing import Any

_ENV_NAME = re.compile(r"\$\{\s*(?:oc\.)?env\s*:\s*([^,}\s$]+)")
_WHOLE_BELOW = 6  # shorter values are replaced only where they stand alone

_values: dict[str, str] = {}  # environment value -> `${oc.env:NAME}`


def _strings(obj: Any):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def remember_env_values(unresolved: Any) -> None:
    """Note the environment value behind every ``${oc.env:NAME}`` in ``unresolved`` (a config
    container or string, before resolution), so later messages can hide it."""
    for text in _strings(unresolved):
        for name in _ENV_NAME.findall(text):
            value = os.environ.get(name)
            if value and value.strip():
                ref = "${oc.env:" + name + "}"
                _values[value] = ref
                for item in _items(value):  # `${oc.decode:...}` makes `[a,b]` a list: its items show alone
                    _values.setdefault(item, ref)


def _items(value: str) -> list[str]:
    """The scalars of a value that reads as a YAML list or mapping (what oc.decode makes of it)."""
    if not value.lstrip().startswith(("[", "{")):
        return []
    import yaml

    try:
        data = yaml.safe_load(value)
    except Exception:
        return []
    out = []
    for leaf in _strings(data) if isinstance(data, (list, dict)) else []:
        out.append(leaf)
    for leaf in (data.values() if isinstance(data, dict) else data if isinstance(data, list) else []):
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            out.append(str(leaf))
    return [x for x in out if x.strip()]


def forget_env_values() -> None:
    """Start over (a new command in the same process)."""
    _values.clear()


def env_values() -> dict[str, str]:
    """The values being hidden -> their interpolation text."""
    return dict(_values)


def redact(text: str) -> str:
    """``text`` with every remembered environment value replaced by its interpolation text."""
    if not _values or not isinstance(text, str):
        return text
    for value in sorted(_values, key=len, reverse=True):  # a value inside a longer one: the longer first
        ref = _values[value]
        if len(value.strip()) >= _WHOLE_BELOW:
            text = text.replace(value, ref)
        else:
            text = re.sub(rf"(?<![\w.]){re.escape(value)}(?!\w|\.\w)", lambda _m: ref, text)
    return text


def redact_all(obj: Any) -> Any:
    """``redact`` over every string in a JSON-like value (keys included)."""
    if not _values:
        return obj
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_all(k): redact_all(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_all(v) for v in obj]
    return obj
