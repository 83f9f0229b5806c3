"""Reading what a checkpoint says about itself: its manifest.json (validated) and the names
and shapes in its DCP metadata (restricted unpickler; optionally every non-tensor value too)."""

from __future__ import annotations

from pathlib import Path

from engine.checkpoint.layout import FORMAT, MANIFEST, READABLE_CHECKPOINT_VERSIONS, STEP_RE, StepDir
from engine.errors import CheckpointError


def read_manifest(step: StepDir) -> dict:
    from engine.checkpoint.io.files import read_json

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
