"""What a checkpoint says about itself: the manifest's body as the trainer hands it over
(``RunManifest``, built here from the run's facts, so the checkpoint package alone decides what a
manifest holds), and reading it back: manifest.json (validated) and the names and shapes in its
DCP metadata (restricted unpickler; optionally every non-tensor value too)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from engine.checkpoint.layout import FORMAT, MANIFEST, READABLE_CHECKPOINT_VERSIONS, STEP_RE, StepDir
from engine.errors import CheckpointError


@dataclass(frozen=True)
class RunManifest:
    """The run-dependent part of manifest.json; ``finalize_checkpoint`` adds the format, step,
    time, files and their hashes."""

    samples_seen: int
    world_size: int
    engine: str
    parallel: dict      # {"dp", "tp", "pp", "cp"}
    model: dict         # preset, path, resolved_path, num_params, params {name: shape, dtype}, lora
    optimizer: dict     # type (the engine's optimizer class), flattened, param_state {name: has state}
    config: dict        # the run's config as saved (interpolations kept)
    versions: dict      # package versions

    def to_json(self) -> dict:
        return asdict(self)


def run_manifest(cfg, *, samples_seen: int, world_size: int, dp_size: int, facts: dict, resolved_model_path: str,
                 saved_config: dict, versions: dict) -> RunManifest:
    """The manifest body of a checkpoint of a run with config ``cfg``; ``facts``: what rank 0's
    engine reports (RankWorker.checkpoint_facts: optimizer type and coverage, param shapes)."""
    e = cfg.engine
    model = {"preset": cfg.model.preset, "path": cfg.model.path, "num_params": facts["num_params"],
             "resolved_path": resolved_model_path, "params": facts["params"]}
    if facts.get("lora"):
        model["lora"] = facts["lora"]
    return RunManifest(
        samples_seen=samples_seen, world_size=world_size, engine=e.name,
        parallel={"dp": dp_size, "tp": getattr(e, "tensor_model_parallel_size", 1),
                  "pp": getattr(e, "pipeline_model_parallel_size", 1), "cp": getattr(e, "context_parallel_size", 1)},
        model=model,
        optimizer={"type": facts["optimizer_type"], "flattened": True, "param_state": facts["param_state"]},
        config=saved_config, versions=versions)


def read_manifest(step: StepDir) -> dict:
    from engine.checkpoint.io.files import read_json

    try:
        m = read_json(step.path / MANIFEST, what=MANIFEST)
    except CheckpointError as e:
        if "not valid JSON" not in e.message:  # unreadable, or far too large: as read_json says
            raise CheckpointError(f"{e.message}{_earlier(step)}", title=e.title) from None
        raise CheckpointError(f"{step.path / MANIFEST} is not valid JSON. A save writes its manifest whole, in one "
                              f"atomic step, so the file was damaged or edited since.{_earlier(step)}",
                              title="corrupt checkpoint") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"{step.path / MANIFEST} is not a JSON object; the checkpoint is damaged.{_earlier(step)}",
                              title="corrupt checkpoint")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{step.path / MANIFEST} is not an rl checkpoint manifest (format "
                              f"{m.get('format')!r}, not {FORMAT!r}): the checkpoint is damaged, or another program "
                              f"wrote it.{_earlier(step)}", title="unsupported checkpoint")
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


def saved_entries(state_dir: Path, shown: str, *, read_values: bool = False):
    """Names and shapes of everything in a DCP directory (metadata, restricted unpickler).
    ``read_values``: also read every non-tensor entry through the restricted unpickler, so a
    value that would run code is refused here, before any rank loads it."""
    from engine.checkpoint.io.dcp import raise_problems, read_dcp, read_object_values

    contents = read_dcp(state_dir, display=shown)
    raise_problems(shown, contents.problems)
    if read_values:
        read_object_values(state_dir, contents, display=shown)
    shapes = {t.name: tuple(t.shape) for t in contents.tensors}
    names = set(shapes) | {o.name for o in contents.objects}
    return names, shapes


def manifest_step(step_dir: Path) -> int:
    m = STEP_RE.match(Path(step_dir).name)
    return int(m.group(1)) if m else 0


def _earlier(step: StepDir) -> str:
    """' The checkpoint before it: `rl resume <path>`.' (the nearest lower step_N with a manifest),
    or ''."""
    from engine.checkpoint.layout import complete_steps

    before = [s for s in complete_steps(step.path.parent) if s.step < step.step]
    return f" The checkpoint before it: `rl resume {before[-1].path}`." if before else ""
