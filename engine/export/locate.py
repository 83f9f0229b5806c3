"""Which checkpoint `rl export PATH` reads, and the refusals: a path that is not an rl
checkpoint, an incomplete save, a damaged one. Reads metadata only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.layout import (FORMAT, MANIFEST, STEP_RE, TMP_PREFIX, complete_steps, list_steps,
                                      manifest_file_problems)
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


def _latest_hint(run_root: Path) -> str:
    done = complete_steps(run_root)
    if not done:
        return " There is no complete checkpoint next to it."
    return f" The latest complete checkpoint there is {done[-1].path.name}: `rl export {done[-1].path}`."


def locate(path: Path) -> SourceCheckpoint:
    """A run root -> its latest complete step_N; a step_N -> that one; anything else refused."""
    path = Path(path)
    shown = str(path)
    if not path.exists():
        raise CheckpointError(f"{shown} does not exist. Pass a run directory (the checkpoint.dir of a run, e.g. "
                              f"`rl export ckpt/`) or one of its step_N directories.", title="no checkpoint")
    if not path.is_dir():
        raise CheckpointError(f"{shown} is a file, not an rl checkpoint. Pass a run directory (e.g. `rl export "
                              f"ckpt/`) or one of its step_N directories.", title="not an rl checkpoint")
    path = path.resolve()
    if (path / EXPORT_MARKER).is_file() or (path / "config.json").is_file():
        raise CheckpointError(f"{shown} is already a Hugging Face model directory (it has config.json), not an rl "
                              f"checkpoint; load it with from_pretrained. Export reads a run directory or its "
                              f"step_N/.", title="not an rl checkpoint")
    if path.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"{shown} is a save that never finished (.tmp-step_N); it is never exported."
                              f"{_latest_hint(path.parent)}", title="incomplete checkpoint")
    if STEP_RE.match(path.name):
        step_dir, step = path, int(STEP_RE.match(path.name).group(1))
        if not (path / MANIFEST).is_file():
            raise CheckpointError(f"{shown} is incomplete: it has no {MANIFEST} (the save did not finish, or the "
                                  f"directory was copied partially).{_latest_hint(path.parent)}",
                                  title="incomplete checkpoint")
    elif path.name == "state" and STEP_RE.match(path.parent.name):
        raise CheckpointError(f"{shown} is the DCP directory inside a checkpoint; pass the step directory: "
                              f"`rl export {path.parent}`.", title="not an rl checkpoint")
    else:
        steps = list_steps(path)
        if not steps:
            raise CheckpointError(f"{shown} is not an rl checkpoint (no step_N/ checkpoints, no {MANIFEST}). Pass "
                                  f"the checkpoint.dir of a run (e.g. `rl export ckpt/`) or a step_N directory.",
                                  title="not an rl checkpoint")
        done = [s for s in steps if s.complete]
        if not done:
            raise CheckpointError(f"{shown} holds only incomplete checkpoints "
                                  f"({', '.join(s.path.name for s in steps)}: no {MANIFEST}); none can be exported.",
                                  title="incomplete checkpoint")
        step_dir, step = done[-1].path, done[-1].step
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
                              f"{_latest_hint(step_dir.parent)}", title="incomplete checkpoint")
    if not (step_dir / "state" / ".metadata").is_file():
        raise CheckpointError(f"{step_dir}/state/.metadata is missing: the DCP shards cannot be read.",
                              title="incomplete checkpoint")
    return SourceCheckpoint(step_dir, step, manifest)
