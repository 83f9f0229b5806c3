"""Which checkpoint `rl export PATH` reads, and the refusals: a path that is not an rl
checkpoint, an incomplete save, a damaged or edited one.

The checkpoint is verified as `rl resume` verifies it (engine/checkpoint/verify.py: structure,
manifest digest, content hashes, cross-checks) and its DCP metadata is read through the
restricted unpickler before any tensor is loaded; the tensors are then loaded with
engine/checkpoint/safe_dcp.py's reader and planner. Nothing in the checkpoint can run code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.find import earlier_hint, find_checkpoint
from engine.checkpoint.layout import STATE_DIR, StepDir
from engine.errors import CheckpointError

EXPORT_MARKER = "rl_export.json"   # written into every exported directory


@dataclass(frozen=True)
class SourceCheckpoint:
    step_dir: Path
    step: int
    manifest: dict

    @property
    def state_dir(self) -> Path:
        return StepDir(self.step_dir, self.step).state

    @property
    def config(self) -> dict:
        return self.manifest.get("config") or {}


def locate(path: Path) -> SourceCheckpoint:
    """A run root -> its latest complete step_N; a step_N -> that one (engine/checkpoint/find.py,
    the rules `rl resume` follows); a Hugging Face directory or a damaged checkpoint refused."""
    path = Path(path)
    if path.is_dir() and ((path / EXPORT_MARKER).is_file() or (path / "config.json").is_file()):
        raise CheckpointError(f"{path} is already a Hugging Face model directory (it has config.json), not an rl "
                              f"checkpoint; load it with from_pretrained. Export reads a run directory or its "
                              f"step_N/.", title="not an rl checkpoint")
    loc = find_checkpoint(path, command="export")
    step_dir, step = loc.step.path, loc.step.step
    from engine.checkpoint.io.dcp import METADATA_FILE
    from engine.checkpoint.manifest import read_manifest, saved_entries
    from engine.checkpoint.verify import raise_if_corrupt, verify_step

    hint = f" Export an earlier step.{earlier_hint(loc.run_root, loc.step, 'export')}"
    try:
        manifest = read_manifest(loc.step)  # bounded JSON, format and version checked
    except CheckpointError as e:
        raise CheckpointError(e.message.replace("resume an earlier one.", "export an earlier step."),
                              title=e.title) from None
    if not (loc.step.state / METADATA_FILE).is_file():
        raise CheckpointError(f"{step_dir}/{STATE_DIR}/{METADATA_FILE} is missing: the DCP shards cannot be "
                              f"read.{hint}", title="incomplete checkpoint")
    raise_if_corrupt(verify_step(step_dir, manifest, content=True), hint)
    # every pickle in the step through the restricted unpickler, as `rl resume` does, before DCP
    # sees any of it: a checkpoint crafted to run code is refused whole, not only where export reads
    from engine.checkpoint.io.safe_unpickle import read_torch_archive

    saved_entries(loc.step.state, str(loc.step.state), read_values=True)
    for f in loc.step.rng_files():
        read_torch_archive(f, display=str(f))
    return SourceCheckpoint(step_dir, step, manifest)
