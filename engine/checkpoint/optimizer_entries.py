"""Per trainable parameter, where its optimizer state comes from on resume: loaded from the
checkpoint, backfilled (the manifest says it had no state yet: AdamW's initial state), or
missing (the manifest says it had state, the checkpoint lacks it: refused unless
--allow-partial). Pure functions over names; used by the plan and by every rank.

Optimizer-state backfill. A trainable parameter that never received a gradient has no AdamW
state; the manifest records that as ``optimizer.param_state[name] = false``. A fresh live
optimizer (DSD initialises one with a zero-gradient step) has entries for every parameter, so
a plain load fails on the absent keys, and DSD's flattened ``set_state_dict`` crashes on empty
entries. Entries the manifest says were absent are *backfilled*: taken from the live
optimizer and reset to AdamW's initial state (step 0, zero moments), which makes the first
update that parameter ever gets identical to an uninterrupted run. Any other absent entry
means a damaged or tampered checkpoint and is refused, naming the parameters, unless
``allow_partial``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from engine.errors import CheckpointError

ADAM_STATE_NAMES = ("step", "exp_avg", "exp_avg_sq")


@dataclass
class OptimizerEntries:
    """Per trainable parameter: where its optimizer state comes from."""

    loaded: list[str] = field(default_factory=list)       # from the checkpoint
    backfilled: list[str] = field(default_factory=list)   # manifest: no state yet -> initial state
    missing: list[str] = field(default_factory=list)      # manifest: had state, checkpoint lacks it
    skip: set[str] = field(default_factory=set)           # optimizer keys not requested from DCP
    reset: set[str] = field(default_factory=set)          # of those, state entries set to initial

    def to_json(self) -> dict:
        return {"loaded": len(self.loaded), "backfilled": self.backfilled, "missing": self.missing}


def param_of(key: str, fqns: set[str]) -> tuple[str, str, str] | None:
    """'state.a.b.exp_avg' -> ('state', 'a.b', 'exp_avg') when 'a.b' is a known parameter."""
    for kind in ("state", "param_groups"):
        if key.startswith(kind + "."):
            rest = key[len(kind) + 1:]
            head, _, name = rest.rpartition(".")
            if head in fqns:
                return kind, head, name
            best = max((f for f in fqns if rest.startswith(f + ".")), key=len, default=None)
            if best is not None:
                return kind, best, rest[len(best) + 1:]
    return None


def classify_optimizer_entries(expected: Iterable[str], saved: set[str], param_state: dict[str, bool],
                               fqns: set[str]) -> OptimizerEntries:
    """``expected``: optimizer keys (without the "optim." prefix) the live optimizer has, or would
    have; ``saved``: those the checkpoint holds; ``param_state``: the manifest's coverage."""
    absent: dict[str, list[str]] = {}
    keys_of: dict[str, list[str]] = {}
    unknown = []
    for key in expected:
        hit = param_of(key, fqns)
        if hit is None:
            if key not in saved:
                unknown.append(key)
            continue
        _kind, fqn, _name = hit
        keys_of.setdefault(fqn, []).append(key)
        if key not in saved:
            absent.setdefault(fqn, []).append(key)
    out = OptimizerEntries()
    for fqn in sorted(keys_of):
        if param_state.get(fqn) is False:
            out.backfilled.append(fqn)
            state_keys = {k for k in keys_of[fqn] if k.startswith("state.")}
            out.skip |= state_keys | set(absent.get(fqn, []))
            out.reset |= state_keys
        elif fqn in absent:
            out.missing.append(fqn)
            out.skip |= set(absent[fqn])
            out.reset |= {k for k in keys_of[fqn] if k.startswith("state.")}
        else:
            out.loaded.append(fqn)
    out.missing += unknown
    return out


def expected_optimizer_keys(saved: set[str], param_state: dict[str, bool], fqns: set[str]) -> list[str]:
    """Without a live optimizer (dry run): every trainable parameter should have the state and
    param-group entries that the checkpoint holds for any parameter."""
    state_names, group_names = set(), set()
    for key in saved:
        hit = param_of(key, fqns)
        if hit:
            (state_names if hit[0] == "state" else group_names).add(hit[2])
    state_names = state_names or set(ADAM_STATE_NAMES)
    out = []
    for fqn in param_state:
        out += [f"state.{fqn}.{n}" for n in sorted(state_names)]
        out += [f"param_groups.{fqn}.{n}" for n in sorted(group_names)]
    return out


def group_names(names: Iterable[str], limit: int = 12) -> list[str]:
    """Parameter names grouped by layer: 'model.layers.*.mlp.up_proj.weight (x12: 0-11)'."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", n), []).append(n)
    out = []
    for pattern, members in groups.items():
        if len(members) == 1:
            out.append(members[0])
        else:
            idx = sorted({int(x) for m in members for x in re.findall(r"\.(\d+)\.", m)})
            span = f"{idx[0]}-{idx[-1]}" if idx and idx == list(range(idx[0], idx[-1] + 1)) else \
                ",".join(map(str, idx[:8]))
            out.append(f"{pattern} (x{len(members)}: {span})")
    if len(out) > limit:
        out = out[:limit] + [f"... and {len(out) - limit} more groups"]
    return out


def split_prefix(names: Iterable[str], prefix: str) -> set[str]:
    return {n[len(prefix):] for n in names if n.startswith(prefix)}


def refuse_missing(missing: list[str], step_dir: Path) -> CheckpointError:
    return CheckpointError(
        f"{step_dir} lacks optimizer state for {len(missing)} parameter(s) that its manifest says had state: "
        f"{'; '.join(group_names(missing))}. The checkpoint was truncated or edited; resuming would restart "
        f"their AdamW moments from zero. Resume an earlier checkpoint, or pass --allow-partial to backfill them "
        f"from the initial optimizer state.", title="optimizer state missing")
