"""Relative paths in a run's config, on a resume from another directory.

`rl train task.path=data/train.jsonl model.path=./policy` saves those values as written, and
they were read relative to the directory `rl train` ran in. `rl resume` of the same run from
anywhere else (a scheduler script that cds to $HOME, another shell) read them relative to *its*
directory: "does not exist" at best, another file of the same name at worst. The run records the
directory it started in (run.json ``cwd``); on resume, a relative model or dataset path that the
resume does not override, and that exists under the start directory, is read from there
(absolute in the resumed config, so every later checkpoint records where it came from).

Reward functions are modules, imported with the current directory importable (as in TRL
scripts); that rule stays, because a run directory may come from anywhere and must not choose
where code is imported from. A resume from elsewhere of a run that names its own functions gets
a warning naming both directories (and an import that fails says where the run started).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional

from engine import json_safe
from engine.checkpoint.layout import RUN_FILE

PATH_KEYS = (("model", "path"), ("task", "path"), ("critic", "model_path"))


def run_start_dir(root: Path) -> Optional[Path]:
    """The directory `rl train` of the run at ``root`` ran in (run.json ``cwd``), when recorded
    and still a directory; None otherwise (runs written before it was recorded, a moved run)."""
    try:
        raw = json_safe.loads((Path(root) / RUN_FILE).read_text())
        cwd = raw.get("cwd") if isinstance(raw, dict) else None
        if isinstance(cwd, str) and os.path.isabs(cwd) and os.path.isdir(cwd):
            return Path(cwd)
    except (OSError, ValueError):
        pass
    return None


def anchor_relative_paths(saved_cfg, cfg, start_dir: Path, overridden: set[str]) -> list[str]:
    """Point the relative path keys of ``cfg`` (and ``saved_cfg``, so the resume sees no change)
    that this resume does not override at ``start_dir``, where they exist there (also when the
    current directory has something of the same name: the run read the start directory's).
    Returns ``key=new`` for each."""
    moved = []
    for section, name in PATH_KEYS:
        key = f"{section}.{name}"
        node, saved_node = getattr(cfg, section, None), getattr(saved_cfg, section, None)
        value = getattr(node, name, "") if node is not None else ""
        if key in overridden or not isinstance(value, str) or not value or value.startswith(("~", "$")) \
                or os.path.isabs(value) or getattr(saved_node, name, None) != value:
            continue
        there = start_dir / value
        if not there.exists():
            continue  # a hub id, or gone: resolved as before (the preflight names what is missing)
        setattr(node, name, str(there))
        setattr(saved_node, name, str(there))
        moved.append(f"{key}={there}")
    return moved


def resume_from_elsewhere(root: Path, saved_cfg, cfg, overridden: set[str]) -> tuple[list[str], list[str]]:
    """(warnings, refusals) of a resume run from another directory than the run's start: its
    relative paths anchored there (``cfg`` and ``saved_cfg`` changed in place), and its own
    reward modules refused when not importable from here. Both empty from the start directory."""
    start_dir = run_start_dir(root)
    if start_dir is None or start_dir.resolve() == Path.cwd().resolve():
        return [], []
    warnings, refusals = [], []
    moved = anchor_relative_paths(saved_cfg, cfg, start_dir, overridden)
    if moved:
        warnings.append(f"the run started in {start_dir}, not here: its relative paths are read from there "
                        f"({', '.join(moved)}).")
    from engine.rewards.spec import BUILTIN_MODULE, import_locations, named_targets

    user_fns = sorted({t for _k, t in named_targets(cfg.task) if not t.startswith(BUILTIN_MODULE + ":")})
    missing = [t for t in user_fns if not import_locations(t)]
    if missing:  # the import error alone would not say where the run's modules were
        refusals.append(f"the run's reward functions ({', '.join(missing)}) cannot be imported from here "
                        f"({Path.cwd()}); the run started in {start_dir}, where they were. Resume from there: "
                        f"`cd {shlex.quote(str(start_dir))} && rl resume {shlex.quote(str(root))}` (or put their directory on PYTHONPATH).")
    elif user_fns:
        warnings.append(f"the run started in {start_dir}, not here: its reward functions ({', '.join(user_fns)}) "
                        f"are imported with this directory ({Path.cwd()}) importable, as always; resume from "
                        f"{start_dir} to be sure of using the modules the run started with.")
    return warnings, refusals
