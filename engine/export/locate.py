"""Which checkpoint `rl export PATH` reads, and the refusals: a path that is not an rl
checkpoint, an incomplete save, a damaged one. Reads metadata only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.find import find_checkpoint, latest_hint
from engine.checkpoint.layout import FORMAT, MANIFEST, manifest_file_problems
from engine.errors import CheckpointError

EXPORT_MARKER = "rl_export.json"   # written into every exported directory


@dataclass(frozen=True)
class SourceCheckpoint:
    step_dir: Path
    step: int
    manifest: dict

    @property
    def state_dir(self) -> Path:
        return self.step_dir / "state"

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
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{step_dir / MANIFEST} cannot be read ({e}); the checkpoint is damaged. Export an "
                              f"earlier step.", title="corrupt checkpoint") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{step_dir} has a {MANIFEST} that is not an rl checkpoint's (format "
                              f"{manifest.get('format')!r}, expected {FORMAT!r}).", title="not an rl checkpoint")
    problems = manifest_file_problems(step_dir, manifest)
    if problems:
        raise CheckpointError(f"{step_dir} is incomplete: {'; '.join(problems[:3])}"
                              f"{' ...' if len(problems) > 3 else ''}. Export an earlier step."
                              f"{latest_hint(step_dir.parent, 'export')}", title="incomplete checkpoint")
    if not (step_dir / "state" / ".metadata").is_file():
        raise CheckpointError(f"{step_dir}/state/.metadata is missing: the DCP shards cannot be read.",
                              title="incomplete checkpoint")
    return SourceCheckpoint(step_dir, step, manifest)
