"""Reader for `rl`'s own checkpoints (docs/checkpoint-format.md): run roots and step dirs.

A step directory ``step_N`` is complete iff it holds ``manifest.json`` (written last). Its
``state/`` is a DCP directory (model, flattened optimizer state and param groups), ``rng/``
holds per-rank ``torch.save`` files, ``trainer.json`` the step, data position and
scheduler. A complete step whose files do not match its manifest is corrupt (an error);
an incomplete one is reported with the reasons it is incomplete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from engine.checkpoint.layout import (MANIFEST, RNG_DIR, RNG_FILE_RE, RUN_FILE, STATE_DIR, STEP_RE, TMP_STEP_RE,
                                      TRAINER_FILE, StepDir, manifest_file_problems, step_from_name)
from engine.checkpoint.leftovers import find_leftovers
from engine.errors import CheckpointError
from engine.inspect.config_check import check_config
from engine.inspect.coverage import rl_coverage
from engine.checkpoint.io.dcp import read_dcp
from engine.inspect.dcp import fill_object_previews
from engine.checkpoint.io.files import dir_size, list_files, read_json, read_yaml
from engine.checkpoint.io.grouping import rl_group
from engine.inspect.report import (CheckpointReport, FileInfo, ObjectInfo, RunReport,
                                   StepInfo)
from engine.checkpoint.io.safe_unpickle import read_torch_archive
from engine.inspect.torch_save import entries



def is_rl_step(path: Path) -> bool:
    """A step directory: a manifest of ours, or the state/ + trainer.json/rng layout."""
    if not path.is_dir():
        return False
    m = path / MANIFEST
    if m.is_file():
        try:
            return read_json(m, what=MANIFEST).get("format") == "rl-checkpoint"
        except (CheckpointError, AttributeError):
            return bool(STEP_RE.match(path.name) or TMP_STEP_RE.match(path.name))
    step = StepDir.at(path)
    return step.state.is_dir() and (step.trainer_json.exists() or step.rng.is_dir()
                                    or bool(STEP_RE.match(path.name) or TMP_STEP_RE.match(path.name)))


def is_rl_run(path: Path) -> bool:
    """A run root: run.json of ours, or step_N children that look like rl steps."""
    if not path.is_dir():
        return False
    rj = path / RUN_FILE
    if rj.is_file():
        try:
            if read_json(rj, what=RUN_FILE).get("format") == "rl-run":
                return True
        except (CheckpointError, AttributeError):
            pass
    return any(STEP_RE.match(p.name) and is_rl_step(p) for p in path.iterdir())


def _run_root_of(step_dir: Path) -> Optional[Path]:
    parent = step_dir.resolve().parent
    if (parent / RUN_FILE).is_file() or (parent / "config.yaml").is_file():
        return parent
    return None


def verify_rl_step(path: Path, manifest: Optional[dict], shown: str) -> dict:
    """--verify: every file's content hash, the manifest's digest and its cross-checks
    (engine/checkpoint/verify.py); CheckpointError if anything does not match."""
    from engine.checkpoint.verify import raise_if_corrupt, verify_step

    if manifest is None:
        raise CheckpointError(f"{shown} has no {MANIFEST} (an interrupted save or a partial copy): there is "
                              "nothing to verify it against, and rl resume never chooses it.",
                              title="incomplete checkpoint")
    v = verify_step(path, manifest, content=True)
    v.step_dir = shown
    raise_if_corrupt(v)
    return v.to_json() | {"summary": v.summary}


def inspect_rl_step(path: Path, *, display: Optional[str] = None, verify: bool = False) -> CheckpointReport:
    """Report for one `rl` step directory (complete or not). ``verify``: check every file's
    content hash and the manifest's cross-checks first (exit 2 on any mismatch)."""
    shown = display or str(path)
    step = StepDir.at(path)
    manifest: Optional[dict] = None
    if step.manifest_path.is_file():
        manifest = read_json(step.manifest_path, what=f"{shown}/{MANIFEST}")
        if not isinstance(manifest, dict):
            raise CheckpointError(f"{shown}/{MANIFEST} is not a JSON object; it is corrupt.",
                                  title="corrupt checkpoint")
    complete = manifest is not None
    verification = verify_rl_step(path, manifest, shown) if verify else None
    rep = CheckpointReport(path=shown, format="rl", files=list_files(path),
                           complete=complete,
                           format_detail=f"rl checkpoint v{manifest.get('version')}" if complete else
                           "rl checkpoint (no manifest)", verification=verification)
    if not complete:
        why = ("no manifest.json: the save was interrupted, or the directory was copied "
               "by hand; rl resume never chooses it")
        if TMP_STEP_RE.match(path.name):
            why = "a save in progress (.tmp-step_N) or abandoned; the next save removes it"
        rep.incomplete_reasons.append(why)
    problems: list[str] = []

    def trouble(msg: str) -> None:
        # A complete step that does not match its manifest is corrupt; an incomplete one
        # is expected to be partial, so the same finding is just another reason.
        (problems if complete else rep.incomplete_reasons).append(msg)

    if manifest is not None:
        from engine.checkpoint.layout import READABLE_CHECKPOINT_VERSIONS

        if manifest.get("format") != "rl-checkpoint" or \
                manifest.get("version") not in READABLE_CHECKPOINT_VERSIONS:
            rep.notes.append(f"manifest format/version is {manifest.get('format')!r}/"
                             f"{manifest.get('version')!r}; this rl reads rl-checkpoint/"
                             + "|".join(map(str, READABLE_CHECKPOINT_VERSIONS)))
        elif manifest.get("version") == 1:
            rep.notes.append("a version-1 manifest: it records sizes, not content hashes; --verify checks "
                             "sizes and cross-checks only")
        for p in manifest_file_problems(path, manifest):
            trouble(p)

    # state/ (DCP)
    state = step.state
    if state.is_dir():
        try:
            c = read_dcp(state, display=f"{shown}/{STATE_DIR}", group=rl_group)
            if not c.problems:
                fill_object_previews(state, c, display=f"{shown}/{STATE_DIR}")
            rep.tensors.extend(c.tensors)
            rep.objects.extend(c.objects)
            for p in c.problems:
                trouble(f"state/{p}")
            rep.notes.extend(c.notes)
        except CheckpointError as e:
            if complete:
                raise
            rep.incomplete_reasons.append(e.message)
    else:
        trouble("state/ is missing")

    # rng/rank_R.pt
    rng_ranks: list[int] = []
    if step.rng.is_dir():
        for f in step.rng_files():
            if not f.is_file() or f.is_symlink():
                trouble(f"{RNG_DIR}/{f.name} is not a regular file")
                continue
            rank = int(RNG_FILE_RE.match(f.name).group(1))
            rng_ranks.append(rank)
            try:
                archive = read_torch_archive(f, display=f"{shown}/{RNG_DIR}/{f.name}")
            except CheckpointError as e:
                if complete:
                    raise
                rep.incomplete_reasons.append(e.message)
                continue
            t, o = entries(archive.obj, prefix=f"rng.rank_{rank}", group=lambda *_: "rng")
            rep.tensors.extend(t)
            rep.objects.extend(o)

    # trainer.json
    trainer: dict = {}
    tj = step.trainer_json
    if tj.is_file() and not tj.is_symlink():
        try:
            trainer = read_json(tj, what=f"{shown}/{TRAINER_FILE}")
        except CheckpointError as e:
            if complete:
                raise
            rep.incomplete_reasons.append(e.message)
    elif complete:
        trouble("trainer.json is missing")
    if isinstance(trainer, dict):
        for k, v in (trainer.get("data") or {}).items():
            rep.objects.append(ObjectInfo(f"data.{k}", type(v).__name__, "data", preview=_short(v)))
        if "learned_buckets" in trainer:
            v = trainer["learned_buckets"]
            rep.objects.append(ObjectInfo("data.learned_buckets", type(v).__name__, "data",
                                          preview=_short(v)))
        for k, v in (trainer.get("lr_scheduler") or {}).items():
            rep.objects.append(ObjectInfo(f"scheduler.{k}", type(v).__name__, "scheduler",
                                          preview=_short(v)))

    if problems:
        raise CheckpointError(
            f"{shown} does not match its {MANIFEST}: " + "; ".join(problems) + ". The "
            "checkpoint is corrupt (truncated copy or a file replaced by hand); rl resume "
            "would fail on it. Pick an earlier step_N.", title="corrupt checkpoint")

    # facts
    m = manifest or {}
    rep.step = _first_int(m.get("step"), trainer.get("step") if isinstance(trainer, dict) else None,
                          step_from_name(path.name))
    rep.world_size = _first_int(m.get("world_size"), len(rng_ranks) or None)
    if isinstance(m.get("parallel"), dict):
        rep.layout.update(m["parallel"])
    if m.get("engine"):
        rep.layout["engine"] = m["engine"]
    if not m:
        rep.layout["rng_files"] = len(rng_ranks)
    for k in ("samples_seen", "created"):
        if k in m:
            rep.info[k] = m[k]
        elif isinstance(trainer, dict) and k in trainer:
            rep.info[k] = trainer[k]
    if isinstance(trainer, dict) and trainer.get("queued_prompts"):  # trainer.mode sampled ahead (rollout_queue.pt)
        mode = ((m.get("config") or {}).get("trainer") or {}).get("mode", "?") if isinstance(m.get("config"), dict) \
            else "?"
        rep.info["rollouts_ahead"] = f"{trainer['queued_prompts']} prompts sampled, not yet trained (trainer.mode={mode})"
    if isinstance(m.get("model"), dict):
        rep.info["model"] = {k: v for k, v in m["model"].items() if k != "params"}
    if isinstance(m.get("optimizer"), dict):
        rep.info["optimizer"] = m["optimizer"].get("type")
    if rep.world_size and rng_ranks and len(rng_ranks) != rep.world_size:
        rep.notes.append(f"{len(rng_ranks)} rng file(s) for world size {rep.world_size}")
    _compare_manifest_params(rep, m)

    root = _run_root_of(path)
    rep.config = m.get("config") if isinstance(m.get("config"), dict) else None
    if rep.config is None and root is not None and (root / "config.yaml").is_file():
        cfg = read_yaml(root / "config.yaml")
        if isinstance(cfg, dict):
            rep.config = cfg
            rep.notes.append("config from the run root's config.yaml (no manifest config)")
    if isinstance(m.get("versions"), dict):
        rep.versions = {str(k): str(v) for k, v in m["versions"].items()}
    elif root is not None and (root / "versions.json").is_file():
        try:
            v = read_json(root / "versions.json", what="versions.json")
            rep.versions = {str(k): str(x) for k, x in v.items()} if isinstance(v, dict) else {}
        except CheckpointError:
            pass

    opt = m.get("optimizer") if isinstance(m.get("optimizer"), dict) else {}
    param_state = opt.get("param_state") if isinstance(opt.get("param_state"), dict) else None
    rep.optimizer = rl_coverage([t.name for t in rep.tensors] + [o.name for o in rep.objects],
                                param_state)
    rep.config_issues, rep.config_check = check_config(rep.config)
    return rep


def _compare_manifest_params(rep: CheckpointReport, m: dict) -> None:
    """Note any parameter whose manifest shape/dtype differs from the state metadata."""
    params = (m.get("model") or {}).get("params") if isinstance(m.get("model"), dict) else None
    if not isinstance(params, dict):
        return
    have = {t.name: t for t in rep.tensors}
    for fqn, spec in params.items():
        if not isinstance(spec, dict) or "shape" not in spec:
            continue
        t = have.get(f"model.{fqn}") or have.get(fqn)
        if t is None:
            rep.notes.append(f"manifest lists parameter {fqn} but state/ has no such tensor")
        elif list(t.shape) != list(spec.get("shape", [])) or (
                spec.get("dtype") and spec["dtype"] != t.dtype):
            rep.notes.append(f"{fqn}: manifest says {spec.get('dtype')} {spec.get('shape')}, "
                             f"state/ holds {t.dtype} {list(t.shape)}")


def _first_int(*values: Any) -> Optional[int]:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _short(v: Any, limit: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def inspect_rl_run(path: Path, *, display: Optional[str] = None, verify: bool = False) -> RunReport:
    """Every step of an `rl` run root, complete or not, with sizes and the latest.
    ``verify``: verify every complete step (CheckpointError naming those that fail)."""
    shown = display or str(path)
    run = RunReport(path=shown, format="rl-run")
    for name in ("run.json", "config.yaml", "overrides.yaml", "versions.json", "metrics.jsonl"):
        p = path / name
        if p.is_file():
            run.files.append(FileInfo(name, p.stat().st_size))
    if (path / RUN_FILE).is_file():
        try:
            rj = read_json(path / RUN_FILE, what=RUN_FILE)
            if isinstance(rj, dict):
                run.info.update({k: rj[k] for k in ("created", "engine", "version") if k in rj})
        except CheckpointError as e:
            run.notes.append(e.message)
    if (path / "versions.json").is_file():
        try:
            v = read_json(path / "versions.json", what="versions.json")
            if isinstance(v, dict):
                run.versions = {str(k): str(x) for k, x in v.items()}
        except CheckpointError as e:
            run.notes.append(e.message)

    for d in sorted(path.iterdir(), key=lambda p: (step_from_name(p.name) or -1, p.name)):
        if not d.is_dir():
            continue
        step = step_from_name(d.name)
        if step is None:
            continue
        size, count = dir_size(d)
        info = StepInfo(name=d.name, step=step, complete=False, bytes=size, files=count)
        if TMP_STEP_RE.match(d.name):
            info.reason = ("leftover: a save in progress or abandoned (never chosen; the next save, rl resume "
                           "or rl train here removes it)")
        elif d.name.startswith(".stale-"):
            info.reason = ("leftover: an incomplete step dir moved aside by a later save (never chosen; rl resume "
                           "or rl train here removes it)")
        elif d.name.startswith(".deleting-"):
            info.reason = ("leftover: a pruned checkpoint whose deletion was interrupted (never chosen; rl resume "
                           "or rl train here removes it)")
        elif not (d / MANIFEST).is_file():
            info.reason = "no manifest.json (interrupted save or hand copy; never chosen)"
        else:
            try:
                m = read_json(d / MANIFEST, what=f"{d.name}/{MANIFEST}")
                info.complete = True
                if isinstance(m, dict):
                    info.created = str(m.get("created", ""))
                    sv = m.get("samples_seen")
                    info.samples_seen = sv if isinstance(sv, int) else None
                    problems = manifest_file_problems(d, m)
                    if problems:
                        info.reason = "corrupt: " + "; ".join(problems)
            except CheckpointError as e:
                info.reason = e.message
        run.steps.append(info)

    leftovers = [p.name for p in find_leftovers(path)]
    if leftovers:
        run.info["leftovers"] = leftovers
        run.notes.append(f"{len(leftovers)} leftover(s) of interrupted saves or prunes: {', '.join(leftovers[:6])}"
                         f"{' ...' if len(leftovers) > 6 else ''}; the next `rl resume {shown}` removes them.")
    # "Latest" as rl resume defines it: the complete (manifest-holding) step with the highest N.
    complete = [s for s in run.steps if s.complete]
    if complete:
        latest = max(complete, key=lambda s: s.step or 0)
        latest.latest = True
        run.latest = latest.name
        if latest.reason:
            run.notes.append(f"the latest step, {latest.name}, does not match its manifest; "
                             "rl resume would pick it and fail: move it aside")
    if not run.steps:
        run.notes.append("no step_N directories yet")
    if verify:
        _verify_run(path, run)
    return run


def _verify_run(path: Path, run: RunReport) -> None:
    from engine.checkpoint.verify import verify_step

    bad = []
    checked = 0
    for info in run.steps:
        if not info.complete or not STEP_RE.match(info.name):
            continue
        checked += 1
        try:
            m = read_json(path / info.name / MANIFEST, what=f"{info.name}/{MANIFEST}")
            v = verify_step(path / info.name, m if isinstance(m, dict) else {}, content=True)
            info.verification = v.to_json() | {"summary": v.summary}
            problems = v.problems
        except CheckpointError as e:
            problems = [e.message]
        if problems:
            bad.append(f"{info.name}: {'; '.join(problems[:3])}")
    if bad:
        raise CheckpointError(f"{run.path}: {len(bad)} checkpoint(s) do not match their manifest: "
                              + " | ".join(bad[:6]) + ". Move the damaged ones aside; rl resume picks the "
                              "latest complete step_N.", title="corrupt checkpoint")
    if not checked:
        # a script's `rl inspect-ckpt ckpt/ --verify && deploy` must not pass on nothing
        partial = len(run.steps)
        raise CheckpointError(
            f"{run.path}: nothing to verify: no complete step_N checkpoint"
            + (f" ({partial} incomplete or unrecognised step director{'y' if partial == 1 else 'ies'})" if partial else "")
            + ". --verify checks complete checkpoints only; see what is there with `rl inspect-ckpt "
            f"{run.path}` (without --verify).", title="nothing verified")
