"""The resume plan: everything `rl resume PATH OVERRIDES` would do, read from disk (no
torch.distributed, nothing written), and the refusals the user can fix:

    plan = plan_resume(Path("ckpt/"), ["trainer.total_steps=80"], allow_partial=False)
    plan.raise_if_refused()            # CheckpointError (exit 2) naming what cannot be honoured
    train(plan.config, run_root, resume=plan)   # the trainer calls plan.apply(workers, stream)

``apply`` has every rank restore its state (engine/checkpoint/restore.py), then restores the data
position and rewrites the run directory's row files (engine/checkpoint/run_files.py)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.checkpoint.find import earlier_hint, find_checkpoint
from engine.checkpoint.layout import MANIFEST, RNG_FILE_RE, rng_relpath
from engine.checkpoint.manifest import read_manifest, saved_entries
from engine.checkpoint.optimizer_entries import (OptimizerEntries, classify_optimizer_entries,
                                                 expected_optimizer_keys, group_names, refuse_missing,
                                                 split_prefix)
from engine.checkpoint.resume_rules import ConfigChange, classify_changes
from engine.checkpoint.start_dir import resume_from_elsewhere
from engine.checkpoint.carried_rows import missing_rows, repair_row_files
from engine.checkpoint.run_files import RESUME_LOG, count_rows_after, lines_of, row_step, span
from engine.errors import CheckpointError, UserError


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
    loaded: list[dict] = field(default_factory=list)   # per-rank reports, filled by apply()
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

    # -- doing it (called by engine.trainer.trainer.train once the ranks are up)
    def apply(self, workers, stream) -> int:
        """Load every rank, restore the data position, drop metric rows after the step.
        Returns the step training continues after."""
        self.raise_if_refused()
        saved = {k: self.data.get(k) for k in ("n", "seed", "shuffle")}
        live = {"n": stream.n, "seed": stream.seed, "shuffle": stream.shuffle}
        if saved != live:
            raise CheckpointError(
                f"The prompt set differs from the checkpoint's: saved {saved}, now {live} (the prompt file or task "
                f"changed). The saved data position would point at other prompts; resume with the original prompts.",
                title="cannot resume")
        self.loaded = workers.load(self.step_dir, {"allow_partial": self.allow_partial, "step": self.step})
        got = sorted({n for r in self.loaded for n in r["optimizer"]["backfilled"]})
        want = sorted(set(self.optimizer.backfilled) | (set(self.optimizer.missing) if self.allow_partial else set()))
        if got != want:
            self.warnings.append(f"the ranks backfilled {len(got)} parameter(s), the plan expected {len(want)}: "
                                 f"{group_names(sorted(set(got) ^ set(want)))}")
        stream.load_state_dict(self.data)
        self._rewrite_run_dir()
        return self.step

    def _rewrite_run_dir(self) -> None:
        root = Path(self.run_dir)
        stamp = int(time.time())
        for name in self.later_checkpoints:  # an explicit older step: the abandoned future is set aside
            src = root / name
            if src.exists():
                os.replace(src, root / f".superseded-{name}-{stamp}")
        # rows after the step and torn rows dropped, rows the checkpoint carries put back
        self.rows_restored = repair_row_files(root, Path(self.step_dir), self.step)
        from engine.user_paths import append_to_run_file

        append_to_run_file(root / RESUME_LOG, (json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                                                          | self.to_json(), default=str) + "\n").encode())


def _as_written(change: ConfigChange, saved_raw: dict, overrides: list[str]) -> ConfigChange:
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
    from engine.config.load import apply_overrides_to, config_from_dict, diff_configs, parse_override

    overrides = list(overrides or [])
    loc = find_checkpoint(Path(path))
    step, root = loc.step, loc.run_root
    manifest = read_manifest(step)
    from engine.checkpoint.verify import raise_if_corrupt, verify_step
    from engine.checkpoint.io.files import read_json

    verification = verify_step(step.path, manifest, content=verify)
    raise_if_corrupt(verification, f" Resume an earlier checkpoint.{earlier_hint(root, step)}")
    try:
        trainer_state = read_json(step.trainer_json, what=str(step.trainer_json))
    except CheckpointError as e:
        raise CheckpointError(f"{e.message} Resume an earlier checkpoint.{earlier_hint(root, step)}",
                              title="corrupt checkpoint") from None

    try:
        saved_cfg = config_from_dict(manifest["config"])
    except UserError as e:
        raise CheckpointError(f"The config saved in {step.path / MANIFEST} no longer validates: {e.message} "
                              f"Resume it with the rl version that wrote it.",
                              title="incompatible checkpoint") from None
    refusals: list[str] = []
    applied = []
    for o in overrides:  # the engine is a config group: refuse it here, by name, not as an unknown key
        _prefix, key, value = parse_override(o)
        if key in ("engine", "engine.name") and value != saved_cfg.engine.name:
            refusals.append(f"`{o}`: the engine cannot change on resume; {step.path} was written by the "
                            f"{saved_cfg.engine.name} engine and its optimizer state layout belongs to it. Drop the "
                            f"override, or start a new run with `rl train ... checkpoint.dir=<new dir>`.")
        else:
            applied.append(o)
    cfg = apply_overrides_to(saved_cfg, applied)
    warnings, elsewhere_refusals = resume_from_elsewhere(root, saved_cfg, cfg, {parse_override(o)[1] for o in applied})
    refusals += elsewhere_refusals
    from engine.rewards.spec import refuse_code_inside

    refuse_code_inside(cfg.task, root, "the run's config")  # before anything imports the functions
    # the run continues where it was found, whatever checkpoint.dir said when it was written
    want_dir = Path(cfg.checkpoint.dir) if any(o.startswith("checkpoint.dir=") for o in overrides) else root
    if want_dir.resolve() != root:
        refusals.append(f"checkpoint.dir={cfg.checkpoint.dir}: resume continues in {root}; to branch the run, copy "
                        f"the directory and resume the copy.")
    cfg.checkpoint.dir = str(root)
    saved_cfg.checkpoint.dir = str(root)
    changes = [_as_written(c, manifest["config"], applied) for c in classify_changes(diff_configs(saved_cfg, cfg))]
    for c in changes:
        if not c.allowed:
            refusals.append(f"{c.key} cannot change on resume ({c.then!r} -> {c.now!r}): {c.reason}. Drop the "
                            f"override, or start a new run with `rl train ... checkpoint.dir=<new dir>`.")
    from engine.data.fingerprint import dataset_refusals  # a changed dataset (dataset tasks; engine/data/)

    refusals += dataset_refusals(root, cfg)
    if cfg.trainer.total_steps <= step.step:
        refusals.append(f"The checkpoint is at step {step.step} and trainer.total_steps is "
                        f"{cfg.trainer.total_steps}: nothing is left to run. Extend the run: `rl resume {path} "
                        f"trainer.total_steps={max(step.step * 2, step.step + 1)}`.")
    if manifest["engine"] != cfg.engine.name:
        refusals.append(f"{step.path} was written by the {manifest['engine']} engine; the config says "
                        f"{cfg.engine.name}. Resume with the engine that wrote it.")

    # model and optimizer, from the DCP metadata and the manifest
    names, shapes = saved_entries(step.state, str(step.state), read_values=True)
    model_saved = {k: v for k, v in shapes.items() if k.startswith("model.")}
    params = manifest["model"].get("params") or {}
    bad = [f"{n} (manifest {list(p.get('shape', []))}, state {list(model_saved.get('model.' + n, ()))})"
           for n, p in params.items()
           if "model." + n not in model_saved or tuple(p.get("shape", ())) != model_saved["model." + n]]
    if bad:
        raise CheckpointError(f"{step.path}: the DCP state does not hold the model its manifest describes: "
                              f"{'; '.join(bad[:6])}. The checkpoint is damaged; resume an earlier one."
                              f"{earlier_hint(root, step)}", title="corrupt checkpoint")
    param_state = manifest["optimizer"].get("param_state") or {}
    saved_optim = split_prefix(names, "optim.")
    fqns = set(param_state) | split_prefix(model_saved, "model.")
    entries = classify_optimizer_entries(expected_optimizer_keys(saved_optim, param_state, fqns), saved_optim,
                                         param_state, fqns)
    if verification.legacy:
        warnings.append(f"{step.path / MANIFEST} is version 1: it records sizes, not content hashes, so only sizes "
                        f"and cross-checks were verified.")
    elif not verify:
        warnings.append("--no-verify: file contents were NOT checked against the manifest's hashes (sizes and "
                        "cross-checks were); a damaged shard would be loaded as is.")
    if entries.missing:
        if allow_partial:
            warnings.append(f"--allow-partial: {len(entries.missing)} parameter(s) restart from the initial "
                            f"optimizer state although the checkpoint says they had state: "
                            f"{'; '.join(group_names(entries.missing))}.")
        else:
            refusals.append(refuse_missing(entries.missing, step.path).message)

    from engine.checkpoint.io.safe_unpickle import read_torch_archive

    for f in step.rng_files():  # restricted reader: refuses garbage and code
        read_torch_archive(f, display=str(f))
    world_now = cfg.trainer.nprocs
    rng = []
    for r in range(world_now):
        if r < manifest["world_size"]:  # verification guarantees it exists
            rng.append({"rank": r, "source": rng_relpath(r), "note": ""})
        else:
            rng.append({"rank": r, "source": None,
                        "note": f"no saved RNG (rank did not exist at save, world size {manifest['world_size']}): "
                                f"seed-derived generator"})
    if world_now != manifest["world_size"]:
        warnings.append(f"world size {manifest['world_size']} -> {world_now}: DCP reshards model and optimizer; "
                        f"per-rank sampling streams differ, so the continuation is not bit-exact.")
        unused = sorted(p.name for p in step.rng_files() if int(RNG_FILE_RE.match(p.name).group(1)) >= world_now)
        if unused:
            warnings.append(f"saved RNG of ranks that no longer exist is not used: {', '.join(unused)}.")
    from engine.user_paths import refuse_special_run_files

    refuse_special_run_files(root, error=CheckpointError)
    metric_lines = lines_of(root / "metrics.jsonl")
    broken = [i + 1 for i, ln in enumerate(metric_lines) if row_step(ln) is None]
    if broken:
        warnings.append(f"metrics.jsonl line(s) {', '.join(map(str, broken[:5]))} are not JSON rows (a write cut "
                        f"short by a kill): dropped on resume.")
    rows_restored = missing_rows(root, step.path, step.step)
    for name, steps in rows_restored.items():
        warnings.append(f"{name} lacks the row(s) of step(s) {span(steps)} or holds them cut short (a crash while "
                        f"they were written): put back from {step.path.name}/rows.json.")
    logged = {row_step(ln) for ln in metric_lines} | set(rows_restored.get("metrics.jsonl", []))
    lost = [s for s in range(1, step.step + 1) if s not in logged]
    if lost and logged:
        warnings.append(f"metrics.jsonl has no row for step(s) {span(lost)} and {step.path.name} does not carry "
                        f"them; those rows cannot be recomputed.")
    if loc.later:
        warnings.append(f"rewinding: newer checkpoints {', '.join(loc.later)} are set aside as .superseded-<name>-* "
                        f"(not deleted) and metric rows after step {step.step} are dropped.")

    from engine.env_info import package_versions

    now_versions = package_versions()
    then_versions = manifest.get("versions") or {}
    versions_changed = {k: [then_versions[k], now_versions.get(k)] for k in sorted(then_versions)
                        if k in ("torch", "transformers", "megatron-core", "ray") and then_versions[k] !=
                        now_versions.get(k)}
    if versions_changed:
        warnings.append("package versions differ from the run that wrote the checkpoint: " +
                        ", ".join(f"{k} {a} -> {b}" for k, (a, b) in versions_changed.items()) + ".")

    sched = trainer_state.get("lr_scheduler") or {}
    last_lr = sched.get("_last_lr") or []
    data = dict(trainer_state.get("data") or {})
    return ResumePlan(
        run_dir=str(root), step_dir=str(step.path), step=step.step,
        samples_seen=int(trainer_state.get("samples_seen", manifest.get("samples_seen", 0))),
        created=str(manifest.get("created", "")), total_steps=cfg.trainer.total_steps, engine=manifest["engine"],
        model={"preset": manifest["model"].get("preset"), "path": manifest["model"].get("path"),
               "num_params": manifest["model"].get("num_params"), "tensors": len(model_saved)},
        optimizer=entries, allow_partial=allow_partial,
        lr_scheduler={"last_epoch": sched.get("last_epoch"), "last_lr": last_lr[0] if last_lr else None},
        rng=rng, data=data, world_size_then=int(manifest["world_size"]), world_size_now=world_now,
        parallel_then=dict(manifest.get("parallel") or {}), config_changes=changes, overrides=overrides,
        skipped=loc.skipped, later_checkpoints=loc.later,
        metrics_rows_dropped=count_rows_after(root / "metrics.jsonl", step.step),
        versions_changed=versions_changed, rows_restored=rows_restored, verification=verification.to_json() | {"summary": verification.summary},
        warnings=warnings, refusals=refusals, config=cfg)
