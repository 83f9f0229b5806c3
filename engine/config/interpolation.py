"""Interpolations in config values: resolving them with a clear error, and keeping the
environment's values out of what is saved.

    data = resolve_container(cfg_node)                  # ConfigError naming key and fix
    refs = env_references(OmegaConf.to_container(cfg_node, resolve=False))
    saved = keep_env_references(asdict(cfg), refs)      # `${oc.env:TOKEN}` instead of the token

A value read from the environment (``${oc.env:NAME}``, directly or through another key that
reads it) is treated as a secret: config.yaml and every checkpoint manifest store the
interpolation text, and `rl resume` resolves it again from the environment of the resume.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from engine.errors import ConfigError

_ENV_RE = re.compile(r"\$\{\s*(?:oc\.)?env\s*:")
_REF_RE = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*\}")
_HINT = ("Interpolations may read another config key (`${trainer.seed}`) or an environment variable "
         "(`${oc.env:NAME}`, with a default: `${oc.env:NAME,value}`).")


def resolve_container(node) -> dict:
    """OmegaConf node -> plain dict with every interpolation resolved, or a ConfigError. The
    environment values it reads are remembered first, so no later message shows them
    (engine/secret_values.py)."""
    from omegaconf import OmegaConf

    from engine.secret_values import remember_env_values

    try:
        remember_env_values(OmegaConf.to_container(node, resolve=False))
    except Exception:  # a node omegaconf cannot list unresolved: the resolution below says why
        pass
    try:
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    except Exception as e:  # omegaconf's own errors, and resolvers' (KeyError, ValueError)
        raise interpolation_error(e) from None


def create_resolved(data: dict) -> dict:
    """A plain dict (e.g. a saved config holding `${oc.env:X}`) with interpolations resolved."""
    from omegaconf import OmegaConf

    from engine.secret_values import remember_env_values

    remember_env_values(data)
    try:
        node = OmegaConf.create(data)
    except Exception as e:
        raise interpolation_error(e) from None
    return resolve_container(node)


def interpolation_error(e: Exception) -> ConfigError:
    """Turn omegaconf's resolution error into one paragraph naming the key and the fix."""
    key = getattr(e, "full_key", None) or "a config value"
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    shown = f"`{key}`"
    m = re.search(r"Environment variable '([^']*)' not found", text)
    if m:
        return ConfigError(f"{shown} reads the environment variable {m.group(1)}, which is not set. Export it "
                           f"(`export {m.group(1)}=...`), or give a default: `${{oc.env:{m.group(1)},value}}`.",
                           title="unresolved interpolation")
    m = re.search(r"Interpolation key '([^']*)' not found", text)
    if m:
        return ConfigError(f"{shown} refers to `${{{m.group(1)}}}`, which is not a config key. {_HINT}",
                           title="unresolved interpolation")
    m = re.search(r"Unsupported interpolation type (\w+)", text)
    if (m and m.group(1) == "hydra") or "HydraConfig was not set" in text:
        return ConfigError(f"{shown} uses `${{hydra:...}}`, which only exists inside a Hydra application run; rl "
                           f"composes its config without one. Use an absolute path or `${{oc.env:PWD}}`.",
                           title="unresolved interpolation")
    if m:
        return ConfigError(f"{shown} uses the resolver `{m.group(1)}:`, which rl does not register. {_HINT}",
                           title="unresolved interpolation")
    if type(e).__name__ == "GrammarParseError":
        return ConfigError(f"{shown}: the value is not a valid interpolation ({text}). Write `${{...}}` in full, "
                           f"or quote a literal `$`: `'key=\\${{...}}'`. {_HINT}", title="invalid interpolation")
    return ConfigError(f"{shown} cannot be resolved: {text}. {_HINT}", title="unresolved interpolation")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _strings(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, (list, tuple)):
        return [s for x in v for s in _strings(x)]
    return []


def env_references(unresolved: dict) -> dict[str, Any]:
    """Keys whose value reads the environment (directly, or through keys that do) -> their
    unresolved value (e.g. {"trainer.ray_address": "${oc.env:RAY_TOKEN_ADDR}"})."""
    flat = _flatten(unresolved)
    refs = {k: v for k, v in flat.items() if any(_ENV_RE.search(s) for s in _strings(v))}
    changed = True
    while changed:  # a key interpolating a secret key is as secret
        changed = False
        for k, v in flat.items():
            if k not in refs and any(r in refs for s in _strings(v) for r in _REF_RE.findall(s)):
                refs[k] = v
                changed = True
    return refs


def override_env_references(overrides: list[str]) -> dict[str, str]:
    """The same, for `key=value` override strings (e.g. the overrides of `rl resume`)."""
    out = {}
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if sep and _ENV_RE.search(value):
            out[key.strip()] = value
    return out


def keep_env_references(data: dict, refs: dict[str, Any]) -> dict:
    """A copy of a nested config dict with every key in ``refs`` set back to its
    interpolation text, so the environment's value is never written out."""
    out = copy.deepcopy(data)
    for key, text in refs.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict) and parts[-1] in node:
            node[parts[-1]] = text
    return out
