"""Saving must not change training: an optimizer that has not stepped yet stays that way.

torch's ``get_state_dict`` materialises a fresh optimizer's state for its state dict with a step on
zero gradients at lr 0 (``_init_optim_state``): AdamW then holds step 1 and zero moments. A save
before the policy's first update (PPO's ``critic.warmup_steps``, or a save at step 0) therefore
changed the run: its first real update counted its bias correction from step 2, 0.74x the size of
the same update in a run that had not saved. ``keep_fresh`` undoes that materialisation after the
state dict is taken and drops the state entries it made, so the checkpoint holds no state for those
parameters (``optimizer.param_state`` false: resume backfills fresh state, as a run that never
saved would have)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def keep_fresh(optimizer, for_save: bool) -> Iterator[Callable[[dict], dict]]:
    """Around ``get_state_dict(model, optimizer, flatten_optimizer_state_dict=True)``: yields the
    filter for its flattened optimizer dict (identity unless the optimizer was fresh and this is
    a save), and afterwards leaves a fresh optimizer with no state again."""
    fresh = for_save and not any(optimizer.state.values())
    yield (lambda sd: {k: v for k, v in sd.items() if not k.startswith("state.")}) if fresh else (lambda sd: sd)
    if fresh:
        optimizer.state.clear()
