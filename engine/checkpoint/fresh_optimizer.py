"""Saving must not change training: an optimizer that has not stepped yet stays equivalent to one
that has not.

torch's ``get_state_dict`` materialises a fresh optimizer's state for its state dict with a step on
zero gradients at lr 0 (``_init_optim_state``): AdamW then holds step 1 and zero moments. A save
before an optimizer's first update (the policy's during PPO's ``critic.warmup_steps``, or a critic
whose first update was skipped for a non-finite gradient) therefore changed the run: its first real
update counted its bias correction from step 2, 0.74x the size of the same update in a run that had
not saved. ``keep_fresh`` sets the step that materialisation counted back to 0, in the optimizer
and in the state dict taken (they share the tensors): AdamW's state at step 0 with zero moments is
exactly what its first step creates, so the run goes on as if nothing had been saved, the
checkpoint holds complete state (no backfill on resume), and a resumed run matches.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch


def _zero_steps(state: dict) -> None:
    for st in state.values():
        if "step" in st:
            if isinstance(st["step"], torch.Tensor):
                st["step"].zero_()
            else:
                st["step"] = 0


@contextmanager
def keep_fresh(optimizer, for_save: bool) -> Iterator[Callable[[dict], dict]]:
    """Around ``get_state_dict(model, optimizer, flatten_optimizer_state_dict=True)``: yields the
    fix for its flattened optimizer dict (identity unless the optimizer was fresh and this is a
    save: then every ``state.<param>.step`` entry is 0), and afterwards leaves the optimizer's own
    step counts at 0."""
    fresh = for_save and not any(optimizer.state.values())

    def fix(sd: dict) -> dict:
        if not fresh:
            return sd
        return {k: (v.zero_() if isinstance(v, torch.Tensor) else 0) if k.startswith("state.") and k.endswith(".step")
                else v for k, v in sd.items()}

    yield fix
    if fresh:
        _zero_steps(optimizer.state)
