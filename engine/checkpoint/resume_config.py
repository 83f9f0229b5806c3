"""The config a resumed run continues with: the checkpoint's saved config with the command's
overrides applied, and the refusals of what cannot change on resume (the engine, the
checkpoint directory, keys resume_rules.py refuses, a changed dataset, a run already finished).

Each check takes plain inputs (configs, override strings, paths) and returns plain data; the
resume plan (engine/checkpoint/plan.py) calls them in order and keeps their refusals and
warnings in that order."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.checkpoint.resume_rules import ConfigChange, classify_changes
from engine.checkpoint.start_dir import resume_from_elsewhere

_NEW_RUN = "Drop the override, or start a new run with `rl train ... checkpoint.dir=<new dir>`."


@dataclass
class ResumeConfig:
    """What the overrides made of the saved config."""

    cfg: object                                     # the RunConfig to continue with
    applied: list[str]                              # overrides applied (a refused engine override is not)
    changes: list[ConfigChange]                     # saved -> now, as written (interpolations as text)
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def engine_override_refusals(overrides: list[str], saved_engine: str, step_path: Path) -> tuple[list[str], list[str]]:
    """(applied, refusals): an override that changes the engine (a config group) is refused by
    name here, not as an unknown key; every other override is applied."""
    from engine.config.load import parse_override

    applied, refusals = [], []
    for o in overrides:
        _prefix, key, value = parse_override(o)
        if key in ("engine", "engine.name") and value != saved_engine:
            refusals.append(f"`{o}`: the engine cannot change on resume; {step_path} was written by the "
                            f"{saved_engine} engine and its optimizer state layout belongs to it. {_NEW_RUN}")
        else:
            applied.append(o)
    return applied, refusals


def checkpoint_dir_refusals(cfg_dir: str, overrides: list[str], root: Path) -> list[str]:
    """The run continues where it was found, whatever checkpoint.dir said when it was written; an
    explicit ``checkpoint.dir=`` naming another directory is refused."""
    want_dir = Path(cfg_dir) if any(o.startswith("checkpoint.dir=") for o in overrides) else root
    if want_dir.resolve() != root:
        return [f"checkpoint.dir={cfg_dir}: resume continues in {root}; to branch the run, copy the directory and "
                f"resume the copy."]
    return []


def as_written(change: ConfigChange, saved_raw: dict, overrides: list[str]) -> ConfigChange:
    """``change`` with each side that reads an interpolation (``${oc.env:TOKEN}``, in the saved
    config or in an override) shown as its text, not its resolved value: the plan is printed and
    written to resumes.jsonl, and an environment value is never written out (as in config.yaml
    and the manifests: engine/config/interpolation.py)."""
    from engine.config.load import parse_override

    then, now = change.then, change.now
    node = saved_raw
    for part in change.key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, str) and "${" in node:
        then = node
    for o in overrides:
        _prefix, key, value = parse_override(o)
        if key == change.key and "${" in value:
            now = value
    return replace(change, then=then, now=now)


def change_refusals(changes: list[ConfigChange]) -> list[str]:
    """One refusal per change resume_rules.py does not allow."""
    return [f"{c.key} cannot change on resume ({c.then!r} -> {c.now!r}): {c.reason}. {_NEW_RUN}"
            for c in changes if not c.allowed]


def resume_config(saved_cfg, saved_raw: dict, overrides: list[str], root: Path, step_path: Path) -> ResumeConfig:
    """The saved config (``saved_cfg``, validated from ``saved_raw``, the manifest's config) with
    ``overrides`` applied, for the run in ``root``; refuses reward code inside the run (raises)."""
    from engine.config.load import apply_overrides_to, diff_configs, parse_override
    from engine.rewards.spec import refuse_code_inside

    applied, refusals = engine_override_refusals(overrides, saved_cfg.engine.name, step_path)
    cfg = apply_overrides_to(saved_cfg, applied)
    warnings, elsewhere = resume_from_elsewhere(root, saved_cfg, cfg, {parse_override(o)[1] for o in applied})
    refusals += elsewhere
    refuse_code_inside(cfg.task, root, "the run's config")  # before anything imports the functions
    refusals += checkpoint_dir_refusals(cfg.checkpoint.dir, overrides, root)
    cfg.checkpoint.dir = str(root)
    saved_cfg.checkpoint.dir = str(root)
    changes = [as_written(c, saved_raw, applied) for c in classify_changes(diff_configs(saved_cfg, cfg))]
    refusals += change_refusals(changes)
    return ResumeConfig(cfg=cfg, applied=applied, changes=changes, warnings=warnings, refusals=refusals)


def continuation_refusals(cfg, root: Path, step: int, written_by: str, step_path: Path, path: Path) -> list[str]:
    """Why ``cfg`` cannot continue the checkpoint of ``step`` (at ``step_path``, written by the
    ``written_by`` engine, named ``path`` on the command line): a changed dataset, nothing left
    to run, another engine."""
    from engine.data.fingerprint import dataset_refusals  # a changed dataset (dataset tasks; engine/data/)

    refusals = list(dataset_refusals(root, cfg))
    if cfg.trainer.total_steps <= step:
        refusals.append(f"The checkpoint is at step {step} and trainer.total_steps is {cfg.trainer.total_steps}: "
                        f"nothing is left to run. Extend the run: `rl resume {path} "
                        f"trainer.total_steps={max(step * 2, step + 1)}`.")
    if written_by != cfg.engine.name:
        refusals.append(f"{step_path} was written by the {written_by} engine; the config says "
                        f"{cfg.engine.name}. Resume with the engine that wrote it.")
    return refusals
