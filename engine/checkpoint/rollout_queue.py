"""The rollouts a run sampled ahead of its next steps (trainer.mode=one_step_off|async), kept in a
checkpoint so that resume trains on exactly the samples the uninterrupted run would have
(engine/trainer/rollout_ahead.py). One torch file of tensors, ints and lists: read back with
``weights_only=True``, so loading it runs no code."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from engine.checkpoint.digest import default_algorithm, write_bytes_atomic
from engine.checkpoint.layout import StepDir
from engine.errors import CheckpointError


def save_rollout_queue(step_dir: Path, state: dict) -> dict[str, list]:
    """Write ``state`` (RolloutAhead.state_dict()) into the step dir being saved; returns the
    manifest digest entry, as the ranks' writers do."""
    sd = StepDir.at(step_dir)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    algorithm = default_algorithm()
    return {sd.relative(sd.rollout_queue): [len(data), write_bytes_atomic(sd.rollout_queue, data, algorithm),
                                            algorithm]}


def load_rollout_queue(step_dir: Path) -> dict:
    sd = StepDir.at(step_dir)
    if not sd.rollout_queue.is_file():
        raise CheckpointError(
            f"{step_dir} has no {sd.rollout_queue.name}: it was saved by a run that did not sample ahead "
            f"(trainer.mode=sync), so there are no queued rollouts to continue with. Resume it with the mode it "
            f"was saved with.", title="cannot resume")
    return torch.load(sd.rollout_queue, map_location="cpu", weights_only=True)
