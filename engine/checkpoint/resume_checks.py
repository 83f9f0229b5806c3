"""The checks `rl resume` makes of a checkpoint's contents and its run directory, one function
each: the checkpoint read and verified, the model its state holds, where each parameter's
optimizer state comes from, which saved RNG each rank gets, the row files, package versions,
the data position. Each takes plain inputs (paths, dicts, names) and returns plain data with
the warnings and refusals it found; the resume plan (engine/checkpoint/plan.py) calls them in
order, and the trainer (engine/trainer/resume.py) makes the last two checks once the ranks are up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoint.find import earlier_hint
from engine.checkpoint.layout import MANIFEST, RNG_FILE_RE, StepDir, rng_relpath
from engine.checkpoint.optimizer_entries import (OptimizerEntries, classify_optimizer_entries,
                                                 expected_optimizer_keys, group_names, refuse_missing,
                                                 split_prefix)
from engine.errors import CheckpointError, UserError

WATCHED_PACKAGES = ("torch", "transformers", "megatron-core", "ray")


@dataclass
class CheckpointRead:
    """A verified checkpoint: its manifest, trainer.json, the config it was written with."""

    manifest: dict
    trainer_state: dict
    saved_cfg: object               # the manifest's config, validated (a RunConfig)
    verification: object            # engine.checkpoint.verify.Verification


def read_checkpoint(step: StepDir, root: Path, verify: bool) -> CheckpointRead:
    """Verify ``step`` (content hashes too unless ``verify`` is false), read its trainer.json and
    validate the config it saved; raises CheckpointError naming an earlier checkpoint to resume."""
    from engine.checkpoint.io.files import read_json
    from engine.checkpoint.manifest import read_manifest
    from engine.checkpoint.verify import raise_if_corrupt, verify_step
    from engine.config.load import config_from_dict

    manifest = read_manifest(step)
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
    return CheckpointRead(manifest, trainer_state, saved_cfg, verification)


def verification_warnings(legacy: bool, verify: bool, manifest_path: Path) -> list[str]:
    """What the verification did not check: a version-1 manifest has no hashes; --no-verify skips them."""
    if legacy:
        return [f"{manifest_path} is version 1: it records sizes, not content hashes, so only sizes and "
                f"cross-checks were verified."]
    if not verify:
        return ["--no-verify: file contents were NOT checked against the manifest's hashes (sizes and "
                "cross-checks were); a damaged shard would be loaded as is."]
    return []


def model_mismatches(params: dict, model_saved: dict) -> list[str]:
    """The manifest's parameters (name -> {"shape"}) the DCP state (``model.<name>`` -> shape)
    lacks or holds with another shape, each as "name (manifest [..], state [..])"."""
    return [f"{n} (manifest {list(p.get('shape', []))}, state {list(model_saved.get('model.' + n, ()))})"
            for n, p in params.items()
            if "model." + n not in model_saved or tuple(p.get("shape", ())) != model_saved["model." + n]]


@dataclass
class SavedState:
    """The entries of a checkpoint's DCP state: every name, and the model's shapes."""

    names: set
    model: dict                     # "model.<fqn>" -> shape


def saved_state(step: StepDir, manifest_model: dict, root: Path) -> SavedState:
    """The DCP state's entries (every value through the restricted reader); raises when it does
    not hold the model its manifest describes."""
    from engine.checkpoint.manifest import saved_entries

    names, shapes = saved_entries(step.state, str(step.state), read_values=True)
    model_saved = {k: v for k, v in shapes.items() if k.startswith("model.")}
    bad = model_mismatches(manifest_model.get("params") or {}, model_saved)
    if bad:
        raise CheckpointError(f"{step.path}: the DCP state does not hold the model its manifest describes: "
                              f"{'; '.join(bad[:6])}. The checkpoint is damaged; resume an earlier one."
                              f"{earlier_hint(root, step)}", title="corrupt checkpoint")
    return SavedState(set(names), model_saved)


@dataclass
class OptimizerCoverage:
    entries: OptimizerEntries
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def optimizer_coverage(names, model_saved: dict, param_state: dict, allow_partial: bool,
                       step_path: Path) -> OptimizerCoverage:
    """Per parameter, where its optimizer state comes from (loaded, backfilled, missing); missing
    entries are refused unless ``allow_partial``, which warns instead."""
    saved_optim = split_prefix(names, "optim.")
    fqns = set(param_state) | split_prefix(model_saved, "model.")
    entries = classify_optimizer_entries(expected_optimizer_keys(saved_optim, param_state, fqns), saved_optim,
                                         param_state, fqns)
    out = OptimizerCoverage(entries)
    if entries.missing and allow_partial:
        out.warnings.append(f"--allow-partial: {len(entries.missing)} parameter(s) restart from the initial "
                            f"optimizer state although the checkpoint says they had state: "
                            f"{'; '.join(group_names(entries.missing))}.")
    elif entries.missing:
        out.refusals.append(refuse_missing(entries.missing, step_path).message)
    return out


def check_rng_files(files: list[Path]) -> None:
    """Every saved RNG file through the restricted reader: refuses garbage and code."""
    from engine.checkpoint.io.safe_unpickle import read_torch_archive

    for f in files:
        read_torch_archive(f, display=str(f))


@dataclass
class RngPlan:
    ranks: list[dict]               # per rank now: {"rank", "source" | None, "note"}
    warnings: list[str] = field(default_factory=list)


def rng_plan(world_then: int, world_now: int, saved_names: list[str]) -> RngPlan:
    """Which saved RNG file each rank now restores (``saved_names``: the rng/ files' names); a
    rank that did not exist at save gets a seed-derived generator."""
    ranks = [{"rank": r, "source": rng_relpath(r), "note": ""} if r < world_then else
             {"rank": r, "source": None, "note": f"no saved RNG (rank did not exist at save, world size "
                                                 f"{world_then}): seed-derived generator"}
             for r in range(world_now)]
    out = RngPlan(ranks)
    if world_now != world_then:
        out.warnings.append(f"world size {world_then} -> {world_now}: DCP reshards model and optimizer; per-rank "
                            f"sampling streams differ, so the continuation is not bit-exact.")
        unused = sorted(n for n in saved_names if int(RNG_FILE_RE.match(n).group(1)) >= world_now)
        if unused:
            out.warnings.append(f"saved RNG of ranks that no longer exist is not used: {', '.join(unused)}.")
    return out


@dataclass
class RowFiles:
    rows_restored: dict             # row file -> steps put back from the step's rows.json
    warnings: list[str] = field(default_factory=list)


def row_files(root: Path, step_path: Path, step: int) -> RowFiles:
    """What resume will do to the run's row files: torn metric rows dropped, rows the checkpoint
    carries put back, steps whose rows are lost for good named. Refuses run files that are not
    regular files."""
    from engine.checkpoint.carried_rows import missing_rows
    from engine.checkpoint.run_files import lines_of, row_step, span
    from engine.user_paths import refuse_special_run_files

    refuse_special_run_files(root, error=CheckpointError)
    metric_lines = lines_of(root / "metrics.jsonl")
    out = RowFiles(missing_rows(root, step_path, step))
    broken = [i + 1 for i, ln in enumerate(metric_lines) if row_step(ln) is None]
    if broken:
        out.warnings.append(f"metrics.jsonl line(s) {', '.join(map(str, broken[:5]))} are not JSON rows (a write "
                            f"cut short by a kill): dropped on resume.")
    for name, steps in out.rows_restored.items():
        out.warnings.append(f"{name} lacks the row(s) of step(s) {span(steps)} or holds them cut short (a crash "
                            f"while they were written): put back from {step_path.name}/rows.json.")
    logged = {row_step(ln) for ln in metric_lines} | set(out.rows_restored.get("metrics.jsonl", []))
    lost = [s for s in range(1, step + 1) if s not in logged]
    if lost and logged:
        out.warnings.append(f"metrics.jsonl has no row for step(s) {span(lost)} and {step_path.name} does not "
                            f"carry them; those rows cannot be recomputed.")
    return out


def rewind_warnings(later: list[str], step: int) -> list[str]:
    """Resuming an older step sets the newer checkpoints aside."""
    if not later:
        return []
    return [f"rewinding: newer checkpoints {', '.join(later)} are set aside as .superseded-<name>-* (not deleted) "
            f"and metric rows after step {step} are dropped."]


def versions_changed(then: dict, now: dict) -> tuple[dict, list[str]]:
    """({package: [then, now]}, warnings) for the watched packages whose version differs."""
    changed = {k: [then[k], now.get(k)] for k in sorted(then) if k in WATCHED_PACKAGES and then[k] != now.get(k)}
    if not changed:
        return changed, []
    return changed, ["package versions differ from the run that wrote the checkpoint: " +
                     ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) + "."]


def trainer_position(trainer_state: dict, manifest: dict) -> dict:
    """Where training stands in the checkpoint: samples seen, the LR schedule, the data position."""
    sched = trainer_state.get("lr_scheduler") or {}
    last_lr = sched.get("_last_lr") or []
    return {"samples_seen": int(trainer_state.get("samples_seen", manifest.get("samples_seen", 0))),
            "lr_scheduler": {"last_epoch": sched.get("last_epoch"), "last_lr": last_lr[0] if last_lr else None},
            "data": dict(trainer_state.get("data") or {})}


def prompt_set_refusal(saved_data: dict, live: dict) -> str | None:
    """Why the saved data position cannot be restored on the prompt set the run has now (its
    size, seed and shuffle, ``live``), or None when it can."""
    saved = {k: saved_data.get(k) for k in ("n", "seed", "shuffle")}
    live = {k: live.get(k) for k in ("n", "seed", "shuffle")}
    if saved == live:
        return None
    return (f"The prompt set differs from the checkpoint's: saved {saved}, now {live} (the prompt file or task "
            f"changed). The saved data position would point at other prompts; resume with the original prompts.")


def backfill_warnings(entries: OptimizerEntries, allow_partial: bool, loaded: list[dict]) -> list[str]:
    """The parameters the ranks backfilled (``loaded``: their reports) against what the plan expected."""
    got = sorted({n for r in loaded for n in r["optimizer"]["backfilled"]})
    want = sorted(set(entries.backfilled) | (set(entries.missing) if allow_partial else set()))
    if got == want:
        return []
    return [f"the ranks backfilled {len(got)} parameter(s), the plan expected {len(want)}: "
            f"{group_names(sorted(set(got) ^ set(want)))}"]
