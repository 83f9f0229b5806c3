"""The resume plan: everything `rl resume PATH OVERRIDES` would do, read from disk (no
torch.distributed, nothing written), and the refusals the user can fix:

    plan = plan_resume(Path("ckpt/"), ["trainer.total_steps=80"], allow_partial=False)
    plan.raise_if_refused()            # CheckpointError (exit 2) naming what cannot be honoured
    train(plan.config, run_root, resume=plan)   # the trainer carries it out: engine/trainer/resume.py

``plan_resume`` is a short sequence of checks that each take plain inputs and return plain data
(engine/checkpoint/resume_config.py: the config and its refused changes;
engine/checkpoint/resume_checks.py: the checkpoint's contents and the run directory), and
assembles their findings, refusals and warnings in order, into a ``ResumePlan``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.checkpoint.find import find_checkpoint
from engine.checkpoint.layout import MANIFEST
from engine.checkpoint.optimizer_entries import OptimizerEntries
from engine.checkpoint.resume_checks import (check_rng_files, optimizer_coverage, read_checkpoint, rewind_warnings,
                                             rng_plan, row_files, saved_state, trainer_position,
                                             verification_warnings, versions_changed)
from engine.checkpoint.resume_config import continuation_refusals, resume_config
from engine.checkpoint.resume_rules import ConfigChange
from engine.checkpoint.run_files import count_rows_after
from engine.errors import CheckpointError


@dataclass
class ResumePlan:
    """What `rl resume` restores, from where, and what it refuses. Built from disk only."""

    run_dir: str
    step_dir: str
    step: int
    samples_seen: int
    created: str
    total_steps: int
    engine: str
    model: dict                     # preset, path, num_params, tensors
    optimizer: OptimizerEntries
    allow_partial: bool
    lr_scheduler: dict              # last_epoch, last_lr
    rng: list[dict]                 # per rank now: {"rank", "source" | None, "note"}
    data: dict                      # epoch, index, samples_seen, n, seed, shuffle
    world_size_then: int
    world_size_now: int
    parallel_then: dict
    config_changes: list[ConfigChange]
    overrides: list[str]
    skipped: list[str]              # newer, not-complete directories not chosen
    later_checkpoints: list[str]    # newer complete checkpoints set aside on apply (rewind)
    metrics_rows_dropped: int
    versions_changed: dict          # package -> [then, now]
    rows_restored: dict = field(default_factory=dict)  # row file -> steps put back from rows.json (carried_rows.py)
    verification: dict = field(default_factory=dict)   # engine.checkpoint.verify.Verification.to_json()
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    loaded: list[dict] = field(default_factory=list)   # per-rank reports, filled by the trainer
    config: object = field(default=None, repr=False)  # the RunConfig to continue with

    # -- reporting
    @property
    def changed(self) -> dict[str, tuple]:
        return {c.key: (c.then, c.now) for c in self.config_changes}

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("config", "optimizer", "config_changes")}
        d["optimizer"] = self.optimizer.to_json() | {"allow_partial": self.allow_partial}
        d["config_changes"] = [c.to_json() for c in self.config_changes]
        d["start_step"] = self.step
        return d

    def raise_if_refused(self) -> None:
        if self.refusals:
            raise CheckpointError(" ".join(self.refusals) + " Nothing was modified.", title="cannot resume")


def plan_resume(path: Path, overrides: list[str] | None = None, *, allow_partial: bool = False,
                verify: bool = True) -> ResumePlan:
    """Everything `rl resume PATH OVERRIDES` would do, read from disk; writes nothing.

    The checkpoint is verified first (engine/checkpoint/verify.py): structure, manifest digest,
    cross-checks, and, unless ``verify`` is false (``--no-verify``), every file's content hash.
    Every non-tensor value in the shards is read through the restricted unpickler, so one that
    would run code is refused here, before any rank starts.

    Raises CheckpointError when there is nothing usable (no checkpoint, only incomplete ones,
    a damaged one). Problems the user can fix by changing the command (a refused override,
    missing optimizer entries) are collected in ``plan.refusals`` so the plan can be shown
    first; ``plan.raise_if_refused()`` turns them into the error.
    """
    from engine.env_info import package_versions

    overrides = list(overrides or [])
    loc = find_checkpoint(Path(path))
    step, root = loc.step, loc.run_root
    read = read_checkpoint(step, root, verify)
    manifest = read.manifest
    conf = resume_config(read.saved_cfg, manifest["config"], overrides, root, step.path)
    cfg = conf.cfg
    refused = continuation_refusals(cfg, root, step.step, manifest["engine"], step.path, path)
    state = saved_state(step, manifest["model"], root)
    optim = optimizer_coverage(state.names, state.model, manifest["optimizer"].get("param_state") or {},
                               allow_partial, step.path)
    check_rng_files(step.rng_files())
    world_then = int(manifest["world_size"])
    rng = rng_plan(world_then, cfg.trainer.nprocs, [p.name for p in step.rng_files()])
    rows = row_files(root, step.path, step.step)
    versions, version_warnings = versions_changed(manifest.get("versions") or {}, package_versions())
    warnings = (conf.warnings + verification_warnings(read.verification.legacy, verify, step.path / MANIFEST)
                + optim.warnings + rng.warnings + rows.warnings + rewind_warnings(loc.later, step.step)
                + version_warnings)
    return ResumePlan(
        run_dir=str(root), step_dir=str(step.path), step=step.step, created=str(manifest.get("created", "")),
        total_steps=cfg.trainer.total_steps, engine=manifest["engine"],
        model={"preset": manifest["model"].get("preset"), "path": manifest["model"].get("path"),
               "num_params": manifest["model"].get("num_params"), "tensors": len(state.model)},
        optimizer=optim.entries, allow_partial=allow_partial, rng=rng.ranks, world_size_then=world_then,
        world_size_now=cfg.trainer.nprocs, parallel_then=dict(manifest.get("parallel") or {}),
        config_changes=conf.changes, overrides=overrides, skipped=loc.skipped, later_checkpoints=loc.later,
        metrics_rows_dropped=count_rows_after(root / "metrics.jsonl", step.step), versions_changed=versions,
        rows_restored=rows.rows_restored,
        verification=read.verification.to_json() | {"summary": read.verification.summary},
        warnings=warnings, refusals=conf.refusals + refused + optim.refusals, config=cfg,
        **trainer_position(read.trainer_state, manifest))
