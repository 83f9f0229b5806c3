"""What `rl eval PATH` evaluates, and under which config: PATH is

* an rl checkpoint (a run directory -> its latest complete step_N, or one step_N): exported to a
  temporary Hugging Face directory by `rl export`'s own code (engine/export: verified, only the
  model entries read, LoRA merged), removed afterwards; the run's config comes from its manifest;
* an `rl export` output (it has rl_export.json): loaded as it is; the run's config comes from the
  source checkpoint's manifest when that is still on disk;
* any Hugging Face causal-LM directory (config.json + weights + tokenizer, e.g. written by
  save_pretrained): loaded as it is, under the default config plus the overrides.

Every refusal is a UserError naming the fix; nothing here writes outside the temporary directory."""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from engine import json_safe
from engine.errors import CheckpointError, UserError
from engine.owned_dirs import OwnedDir

USAGE = ("Pass an rl checkpoint (a run directory such as ckpt/, or one of its step_N directories), the output of "
         "`rl export`, or a Hugging Face causal-LM directory (config.json, weights and tokenizer files, as "
         "save_pretrained writes them).")


@dataclass(frozen=True)
class ModelSource:
    kind: str                      # "checkpoint", "export" or "hf"
    given: str                     # PATH as the user wrote it
    model_dir: str                 # the Hugging Face directory that is loaded
    step: Optional[int] = None     # the checkpoint's step (checkpoint, export)
    step_dir: str = ""             # the checkpoint's step_N directory (checkpoint, export)
    saved_config: Optional[dict] = None  # the run's config as its manifest holds it, when known
    config_from: str = "defaults"  # where the config below the overrides came from

    def to_json(self) -> dict:
        return {"kind": self.kind, "path": self.given, "model_dir": self.model_dir, "step": self.step,
                "step_dir": self.step_dir or None, "config_from": self.config_from}


@contextmanager
def open_model(path: str) -> Iterator[ModelSource]:
    """The model PATH names, as a ModelSource whose ``model_dir`` exists until the block ends."""
    from engine.user_paths import file_kind, shown, stat_path

    given = str(path)
    p = Path(os.path.expanduser(given))
    st = stat_path(p, f"The model path {shown(p)}", title="model not found")
    if st is None:
        raise UserError(f"{shown(p)} does not exist. {USAGE}", title="model not found")
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{shown(p)} is {file_kind(st)}, not a model directory. {USAGE}", title="not a model")
    if (p / "config.json").is_file():
        yield _hf_dir(p, given)
        return
    # the checkpoint's weights as a Hugging Face directory, for this eval only; an eval killed
    # before it removes them (SIGKILL, the OOM killer) leaves them to the next rl eval's sweep
    tmp = OwnedDir("rl-eval-")
    try:
        yield _checkpoint(p, given, tmp.path)
    finally:
        tmp.remove()


def _hf_dir(p: Path, given: str) -> ModelSource:
    from engine.export.locate import EXPORT_MARKER
    from engine.model.source import check_architecture

    check_architecture(str(p))  # a causal LM, no custom code, weights present and whole
    marker = p / EXPORT_MARKER
    if not marker.is_file():
        return ModelSource("hf", given, str(p))
    try:
        info = json_safe.loads(marker.read_text())
    except (OSError, ValueError):
        info = {}
    info = info if isinstance(info, dict) else {}
    step = info.get("step") if isinstance(info.get("step"), int) else None
    source = str(info.get("source") or "")
    manifest = _manifest_if_there(source)
    if manifest is None:
        return ModelSource("export", given, str(p), step, source)
    from engine.checkpoint.layout import StepDir

    return ModelSource("export", given, str(p), step, source, manifest.get("config") or {},
                       f"{StepDir.at(source).manifest_path} (the export's source checkpoint)")


def _manifest_if_there(step_dir: str) -> Optional[dict]:
    """The manifest of an export's source checkpoint, when it is still there and readable."""
    from engine.checkpoint.layout import StepDir
    from engine.checkpoint.manifest import read_manifest

    if not step_dir or not StepDir.at(step_dir).complete:
        return None
    try:
        return read_manifest(StepDir.at(step_dir))
    except CheckpointError:
        return None


def _checkpoint(p: Path, given: str, tmp: Path) -> ModelSource:
    from engine.checkpoint.layout import StepDir
    from engine.checkpoint.manifest import read_manifest
    from engine.export import export_checkpoint

    try:
        result = export_checkpoint(p, out=tmp / "hf")
    except CheckpointError as e:
        if e.title == "not an rl checkpoint":
            raise CheckpointError(f"{e.message.split(' Pass ')[0]} {USAGE}", title="not a model") from None
        # export's refusals, in this command's words
        message = e.message.replace("`rl export ", "`rl eval ").replace("Export an earlier step",
                                                                          "Evaluate an earlier step")
        raise CheckpointError(message.replace("export an earlier step", "evaluate an earlier step"),
                              title=e.title) from None
    source = StepDir(Path(result.source_step_dir), result.step)
    manifest = read_manifest(source)
    return ModelSource("checkpoint", given, str(tmp / "hf"), result.step, result.source_step_dir,
                       manifest.get("config") or {}, str(source.manifest_path))
