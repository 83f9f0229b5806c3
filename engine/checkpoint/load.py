"""Resuming a run from a checkpoint: find it, plan what is restored, load it on every rank.

Driver side (no torch.distributed, nothing written):

    plan = plan_resume(Path("ckpt/"), ["trainer.total_steps=80"], allow_partial=False)
    plan.raise_if_refused()            # CheckpointError (exit 2) naming what cannot be honoured
    train(plan.config, run_root, resume=plan)   # the trainer calls plan.apply(workers, stream)

Rank side (inside RankWorker.load, collective): ``load_rank_state`` builds the live state with
``engine.checkpoint_state()``, compares it with the checkpoint's DCP metadata and manifest,
loads with a planner that leaves out exactly the optimizer entries that are backfilled, and
hands the result to ``engine.load_checkpoint_state``. It only uses the TrainEngine interface,
so it works for every backend whose optimizer state is flattened as
``state.<param>.<name>`` / ``param_groups.<param>.<name>`` (FSDP2 via DSD, Megatron).

Optimizer-state backfill. A trainable parameter that never received a gradient has no AdamW
state; the manifest records that as ``optimizer.param_state[name] = false``. A fresh live
optimizer (DSD initialises one with a zero-gradient step) has entries for every parameter, so
a plain load fails on the absent keys, and DSD's flattened ``set_state_dict`` crashes on empty
entries. Entries the manifest says were absent are *backfilled*: taken from the live
optimizer and reset to AdamW's initial state (step 0, zero moments), which makes the first
update that parameter ever gets identical to an uninterrupted run. Any other absent entry
means a damaged or tampered checkpoint and is refused, naming the parameters, unless
``allow_partial``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from engine.checkpoint.layout import (FORMAT, MANIFEST, READABLE_CHECKPOINT_VERSIONS, STEP_RE, TMP_PREFIX,
                                      StepDir, complete_steps, list_steps)
from engine.checkpoint.resume_rules import ConfigChange, classify_changes
from engine.errors import CheckpointError, UserError

ADAM_STATE_NAMES = ("step", "exp_avg", "exp_avg_sq")
MEMORY_FILE = "memory.jsonl"
RESUME_LOG = "resumes.jsonl"


# ---- finding the checkpoint -------------------------------------------------------------
@dataclass(frozen=True)
class Located:
    run_root: Path
    step: StepDir
    skipped: list[str]          # newer directories that are not complete checkpoints
    later: list[str]            # newer *complete* checkpoints (only when a step_N was named)


def find_checkpoint(path: Path) -> Located:
    """A run root -> its latest complete step_N (derived from disk); a step_N -> that one."""
    path = Path(path)
    shown = str(path)
    if not path.exists():
        raise CheckpointError(f"{shown} does not exist. Pass a run directory (checkpoint.dir of a run, e.g. "
                              f"`rl resume ckpt/`) or one of its step_N directories.", title="no checkpoint")
    if not path.is_dir():
        raise CheckpointError(f"{shown} is a file. Pass a run directory (e.g. `rl resume ckpt/`) or one of its "
                              f"step_N directories.", title="no checkpoint")
    path = path.resolve()
    if path.name.startswith(TMP_PREFIX):
        run_root = path.parent
        latest = _latest_hint(run_root)
        raise CheckpointError(f"{shown} is a save that never finished (.tmp-step_N directories are never "
                              f"resumed).{latest}", title="incomplete checkpoint")
    if STEP_RE.match(path.name):
        run_root = path.parent
        step = StepDir(path, int(STEP_RE.match(path.name).group(1)))
        if not step.complete:
            raise CheckpointError(f"{shown} is incomplete: it has no {MANIFEST} (the save did not finish, or the "
                                  f"directory was copied partially).{_latest_hint(run_root)}",
                                  title="incomplete checkpoint")
        later = [s.path.name for s in complete_steps(run_root) if s.step > step.step]
        skipped = [s.path.name for s in list_steps(run_root) if s.step > step.step and not s.complete]
        return Located(run_root, step, skipped, later)
    if path.name == "state" and STEP_RE.match(path.parent.name):
        raise CheckpointError(f"{shown} is the DCP directory inside a checkpoint; pass the step directory "
                              f"itself: `rl resume {path.parent}`.", title="no checkpoint")
    steps = list_steps(path)
    tmps = sorted(p.name for p in path.glob(TMP_PREFIX + "*"))
    if not steps:
        if (path / "run.json").is_file():
            interrupted = f" An interrupted save ({', '.join(tmps)}) is never resumed." if tmps else ""
            raise CheckpointError(
                f"{shown} holds a run that has not written a checkpoint yet (it saves every checkpoint.save_freq "
                f"steps).{interrupted} Nothing can be resumed: start it again with `rl train ... "
                f"checkpoint.dir={shown} checkpoint.overwrite=true`.", title="no checkpoint")
        raise CheckpointError(f"{shown} is not an rl run directory (no run.json, no step_N/ checkpoints). Pass the "
                              f"checkpoint.dir of a run, e.g. `rl resume ckpt/`.", title="no checkpoint")
    done = [s for s in steps if s.complete]
    if not done:
        names = ", ".join(s.path.name for s in steps)
        raise CheckpointError(
            f"{shown} holds only incomplete checkpoints ({names}: no {MANIFEST}; their saves did not finish). "
            f"None can be resumed safely. Start the run again with `rl train ... checkpoint.dir={shown} "
            f"checkpoint.overwrite=true`.", title="incomplete checkpoint")
    chosen = done[-1]
    skipped = [s.path.name for s in steps if s.step > chosen.step] + tmps
    return Located(path, chosen, skipped, [])


def _latest_hint(run_root: Path) -> str:
    done = complete_steps(run_root)
    if not done:
        return " There is no complete checkpoint next to it."
    return f" The latest complete checkpoint there is {done[-1].path.name}: `rl resume {done[-1].path}`."


def read_manifest(step: StepDir) -> dict:
    from engine.inspect.files import read_json

    try:
        m = read_json(step.path / MANIFEST, what=str(step.path / MANIFEST))
    except CheckpointError as e:
        raise CheckpointError(f"{e.message} The checkpoint is damaged; resume an earlier one.",
                              title="corrupt checkpoint") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"{step.path / MANIFEST} is not a JSON object; the checkpoint is damaged.",
                              title="corrupt checkpoint")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{step.path / MANIFEST} is not an rl checkpoint manifest (format "
                              f"{m.get('format')!r}).", title="unsupported checkpoint")
    if m.get("version") not in READABLE_CHECKPOINT_VERSIONS:
        raise CheckpointError(f"{step.path} uses checkpoint format version {m.get('version')!r}; this rl reads "
                              f"versions {', '.join(map(str, READABLE_CHECKPOINT_VERSIONS))}. Resume it with the rl "
                              f"version that wrote it.", title="unsupported checkpoint")
    for key, kind in (("step", int), ("world_size", int), ("engine", str), ("model", dict), ("optimizer", dict),
                      ("config", dict)):
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise CheckpointError(f"{step.path / MANIFEST} has no valid {key!r}; the checkpoint is damaged or was "
                                  f"written by another program.", title="corrupt checkpoint")
    return m


# ---- which entries are loaded, backfilled, missing ----------------------------------------
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


def _saved_entries(state_dir: Path, shown: str, *, read_values: bool = False):
    """Names and shapes of everything in a DCP directory (metadata, restricted unpickler).
    ``read_values``: also read every non-tensor entry through the restricted unpickler, so a
    value that would run code is refused here, before any rank loads it."""
    from engine.inspect.dcp import raise_problems, read_dcp, read_object_values

    contents = read_dcp(state_dir, display=shown)
    raise_problems(shown, contents.problems)
    if read_values:
        read_object_values(state_dir, contents, display=shown)
    shapes = {t.name: tuple(t.shape) for t in contents.tensors}
    names = set(shapes) | {o.name for o in contents.objects}
    return names, shapes


def _split(names: Iterable[str], prefix: str) -> set[str]:
    return {n[len(prefix):] for n in names if n.startswith(prefix)}


def _refuse_missing(missing: list[str], step_dir: Path) -> CheckpointError:
    return CheckpointError(
        f"{step_dir} lacks optimizer state for {len(missing)} parameter(s) that its manifest says had state: "
        f"{'; '.join(group_names(missing))}. The checkpoint was truncated or edited; resuming would restart "
        f"their AdamW moments from zero. Resume an earlier checkpoint, or pass --allow-partial to backfill them "
        f"from the initial optimizer state.", title="optimizer state missing")


# ---- the plan ---------------------------------------------------------------------------
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
        truncate_jsonl(root / "metrics.jsonl", self.step)  # also drops a row a kill cut short
        truncate_jsonl(root / MEMORY_FILE, self.step)
        with open(root / RESUME_LOG, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())} | self.to_json(),
                               default=str) + "\n")


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Drop rows whose "step" is after ``last_step``, and rows that are not JSON objects (the
    last row of a run killed mid-write); returns how many were dropped. Rewritten atomically."""
    if not path.is_file():
        return 0
    text = path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if _row_step(ln) is not None and _row_step(ln) <= last_step]
    if len(keep) != len(lines) or (text and not text.endswith("\n")):
        from engine.checkpoint.digest import write_bytes_atomic

        write_bytes_atomic(path, "".join(ln + "\n" for ln in keep).encode())
    return len(lines) - len(keep)


def _row_step(line: str) -> int | None:
    """A row's step (0 when it has none); None when the line is not a JSON object."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict):
        return None
    try:
        return int(row.get("step", 0))
    except (ValueError, TypeError, OverflowError):
        return None


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.is_file() else []


def _count_rows_after(path: Path, step: int) -> int:
    return sum(1 for ln in _lines(path) if (_row_step(ln) or 0) > step)


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)) else \
        ", ".join(map(str, steps[:10]))


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
    from engine.inspect.files import read_json

    verification = verify_step(step.path, manifest, content=verify)
    raise_if_corrupt(verification, f" Resume an earlier checkpoint.{_earlier_hint(root, step)}")
    try:
        trainer_state = read_json(step.path / "trainer.json", what=f"{step.path}/trainer.json")
    except CheckpointError as e:
        raise CheckpointError(f"{e.message} Resume an earlier checkpoint.{_earlier_hint(root, step)}",
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
    # the run continues where it was found, whatever checkpoint.dir said when it was written
    want_dir = Path(cfg.checkpoint.dir) if any(o.startswith("checkpoint.dir=") for o in overrides) else root
    if want_dir.resolve() != root:
        refusals.append(f"checkpoint.dir={cfg.checkpoint.dir}: resume continues in {root}; to branch the run, copy "
                        f"the directory and resume the copy.")
    cfg.checkpoint.dir = str(root)
    saved_cfg.checkpoint.dir = str(root)
    changes = classify_changes(diff_configs(saved_cfg, cfg))
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
    names, shapes = _saved_entries(step.path / "state", str(step.path / "state"), read_values=True)
    model_saved = {k: v for k, v in shapes.items() if k.startswith("model.")}
    params = manifest["model"].get("params") or {}
    bad = [f"{n} (manifest {list(p.get('shape', []))}, state {list(model_saved.get('model.' + n, ()))})"
           for n, p in params.items()
           if "model." + n not in model_saved or tuple(p.get("shape", ())) != model_saved["model." + n]]
    if bad:
        raise CheckpointError(f"{step.path}: the DCP state does not hold the model its manifest describes: "
                              f"{'; '.join(bad[:6])}. The checkpoint is damaged; resume an earlier one."
                              f"{_earlier_hint(root, step)}", title="corrupt checkpoint")
    param_state = manifest["optimizer"].get("param_state") or {}
    saved_optim = _split(names, "optim.")
    fqns = set(param_state) | _split(model_saved, "model.")
    entries = classify_optimizer_entries(expected_optimizer_keys(saved_optim, param_state, fqns), saved_optim,
                                         param_state, fqns)
    warnings = []
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
            refusals.append(_refuse_missing(entries.missing, step.path).message)

    from engine.inspect.safe_unpickle import read_torch_archive

    for f in sorted((step.path / "rng").glob("rank_*.pt")):  # restricted reader: refuses garbage and code
        read_torch_archive(f, display=str(f))
    world_now = cfg.trainer.nprocs
    rng = []
    for r in range(world_now):
        f = step.path / "rng" / f"rank_{r}.pt"
        if r < manifest["world_size"]:  # verification guarantees it exists
            rng.append({"rank": r, "source": f"rng/rank_{r}.pt", "note": ""})
        else:
            rng.append({"rank": r, "source": None,
                        "note": f"no saved RNG (rank did not exist at save, world size {manifest['world_size']}): "
                                f"seed-derived generator"})
    if world_now != manifest["world_size"]:
        warnings.append(f"world size {manifest['world_size']} -> {world_now}: DCP reshards model and optimizer; "
                        f"per-rank sampling streams differ, so the continuation is not bit-exact.")
        unused = sorted(p.name for p in (step.path / "rng").glob("rank_*.pt")
                        if int(p.stem.split("_")[1]) >= world_now)
        if unused:
            warnings.append(f"saved RNG of ranks that no longer exist is not used: {', '.join(unused)}.")
    metric_lines = _lines(root / "metrics.jsonl")
    broken = [i + 1 for i, ln in enumerate(metric_lines) if _row_step(ln) is None]
    if broken:
        warnings.append(f"metrics.jsonl line(s) {', '.join(map(str, broken[:5]))} are not JSON rows (a write cut "
                        f"short by a kill): dropped on resume.")
    logged = {_row_step(ln) for ln in metric_lines}
    lost = [s for s in range(1, step.step + 1) if s not in logged]
    if lost and logged:
        warnings.append(f"metrics.jsonl has no row for step(s) {_span(lost)} (the run stopped between saving a "
                        f"checkpoint and writing its row); those rows cannot be recomputed.")
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
        metrics_rows_dropped=_count_rows_after(root / "metrics.jsonl", step.step),
        versions_changed=versions_changed, verification=verification.to_json() | {"summary": verification.summary},
        warnings=warnings, refusals=refusals, config=cfg)


def _earlier_hint(root: Path, step: StepDir) -> str:
    earlier = [s for s in complete_steps(root) if s.step < step.step]
    return f" Earlier: `rl resume {earlier[-1].path}`." if earlier else ""


# ---- rank side --------------------------------------------------------------------------
def _backfill_planner(skip: set[str]):
    """A DCP load planner that requests everything in the state dict except ``skip`` (flat
    DCP keys), and is strict about the rest: a requested key absent from the checkpoint fails.
    Non-tensor values are unpickled with ``weights_only=True`` (engine/checkpoint/safe_dcp.py),
    never with DCP's default ``weights_only=False``."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from engine.checkpoint.safe_dcp import SafeLoadPlanner

    class BackfillLoadPlanner(SafeLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            super().set_up_planner(state_dict, metadata, is_coordinator)
            self.state_dict = {k: v for k, v in self.state_dict.items() if k not in skip}

        def create_local_plan(self):
            return create_default_local_load_plan(self.state_dict, self.metadata, True)

    return BackfillLoadPlanner()


def _initial(value):
    """AdamW's state before its first update: step 0, zero moments."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, (int, float)):
        return type(value)(0)
    return value


def load_rng_file(path: Path) -> dict:
    """Per-rank RNG state (torch.save of tensors, tuples and numpy's MT19937 state), loaded with
    weights_only=True plus the three numpy globals its state needs."""
    import numpy as np
    import torch

    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    core = getattr(np, "_core", None) or getattr(np, "core")
    allowed.append(core.multiarray._reconstruct)
    from engine.inspect.files import require_regular_file

    require_regular_file(Path(path), str(path))
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, weights_only=True)
    except Exception as e:  # UnpicklingError, a zip reader RuntimeError, EOFError...: never a traceback
        raise CheckpointError(f"{path} is not a readable RNG state ({type(e).__name__}: {str(e)[:300]}). The "
                              f"checkpoint is damaged (or holds objects other than RNG state, which are not "
                              f"loaded); resume an earlier one.", title="corrupt checkpoint") from None
    if not isinstance(state, dict) or not {"torch", "python", "numpy"} <= set(state):
        raise CheckpointError(f"{path} does not hold an RNG state (keys torch, python, numpy); the checkpoint is "
                              f"damaged.", title="corrupt checkpoint")
    return state


def load_rank_state(step_dir: Path, engine, rank: int, generator, plan: dict) -> dict:
    """Load ``step_dir`` into this rank's engine (collective: every rank calls it).

    Refuses (CheckpointError, before anything is loaded, identically on every rank) a model
    that differs from the checkpoint's and optimizer entries that are absent although the
    manifest says they existed (unless ``plan["allow_partial"]``). Returns what it restored.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from engine.checkpoint.save import set_rng_state

    t0 = time.perf_counter()
    step_dir = Path(step_dir)
    manifest = read_manifest(StepDir(step_dir, int(plan.get("step", manifest_step(step_dir)))))
    from engine.inspect.files import read_json

    trainer_state = read_json(step_dir / "trainer.json", what=f"{step_dir}/trainer.json")
    if not isinstance(trainer_state, dict):
        raise CheckpointError(f"{step_dir}/trainer.json is not a JSON object; the checkpoint is damaged.",
                              title="corrupt checkpoint")
    names, shapes = _saved_entries(step_dir / "state", str(step_dir / "state"))

    state = engine.checkpoint_state()   # live, DCP-shaped; a fresh optimizer gets entries for every param
    live_model = state["model"]
    saved_model = _split(names, "model.")
    lacking = sorted(set(live_model) - saved_model)
    extra = sorted(saved_model - set(live_model))
    mism = [f"{k} (checkpoint {list(shapes['model.' + k])}, model {list(v.shape)})" for k, v in live_model.items()
            if k in saved_model and isinstance(v, torch.Tensor) and tuple(v.shape) != shapes.get("model." + k)]
    if lacking or extra or mism:
        parts = []
        if lacking:
            parts.append(f"weights the checkpoint lacks: {'; '.join(group_names(lacking, 6))}")
        if extra:
            parts.append(f"checkpoint weights this model lacks: {'; '.join(group_names(extra, 6))}")
        if mism:
            parts.append(f"shapes differ: {'; '.join(mism[:6])}")
        raise CheckpointError(f"{step_dir} holds a different model than this config builds ({'. '.join(parts)}). "
                              f"Resume with the model config the run was started with.", title="model differs")

    param_state = manifest["optimizer"].get("param_state") or {}
    entries = classify_optimizer_entries(state["optim"].keys(), _split(names, "optim."), param_state,
                                         set(live_model) | set(param_state))
    if entries.missing and not plan.get("allow_partial"):
        raise _refuse_missing(entries.missing, step_dir)
    backfilled = entries.backfilled + (entries.missing if plan.get("allow_partial") else [])

    try:
        from engine.checkpoint.safe_dcp import safe_reader

        dcp.load(state, storage_reader=safe_reader(step_dir / "state"),
                 planner=_backfill_planner({"optim." + k for k in entries.skip}))
    except CheckpointException as e:  # a BaseException: turn it into an error the CLI prints
        raise CheckpointError(f"Loading {step_dir / 'state'} failed: {str(e)[:600]}", title="load failed") from None
    for k in entries.reset:
        state["optim"][k] = _initial(state["optim"][k])
    engine.load_checkpoint_state(state)

    sched = trainer_state.get("lr_scheduler")
    if sched:
        engine.lr_scheduler.load_state_dict(sched)
    buckets = _restore_buckets(engine, trainer_state.get("learned_buckets"))

    rng_file = step_dir / "rng" / f"rank_{rank}.pt"
    rng_source = None
    if rank < manifest["world_size"] and not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing although rank {rank} existed at save (world size "
                              f"{manifest['world_size']}); the checkpoint is damaged.", title="corrupt checkpoint")
    if rng_file.is_file():
        set_rng_state(load_rng_file(rng_file), generator)
        rng_source = f"rng/rank_{rank}.pt"
    return {"rank": rank, "model_tensors": len(live_model),
            "optimizer": {"loaded": len(entries.loaded), "backfilled": backfilled},
            "lr_scheduler": {"last_epoch": (sched or {}).get("last_epoch")},
            "rng": rng_source, "buckets": buckets, "seconds": round(time.perf_counter() - t0, 4)}


def manifest_step(step_dir: Path) -> int:
    m = STEP_RE.match(Path(step_dir).name)
    return int(m.group(1)) if m else 0


def _restore_buckets(engine, saved) -> str:
    policy = getattr(engine, "bucket_policy", None)
    if policy is None or not isinstance(saved, dict) or not saved:
        return "none"
    if saved.get("policy") != getattr(policy, "name", None):
        return f"fresh ({saved.get('policy')} -> {getattr(policy, 'name', None)})"
    policy.load_state_dict(saved)
    return "restored"
