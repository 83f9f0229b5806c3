"""Where a run stands, as numbers the CLI draws: step k of N, the time since the steps began, the
time a step takes now (the mean of the last ``window`` steps' wall times: a moving average, so a
slow first step (compilation, warm caches) and a changed pace fade out) and the time left
(ETA = that mean x the steps left).

    clock = StepClock(start_step=0, total_steps=40)
    on_event(clock.start())          # step 0/40, no ETA yet
    ... each step ends: on_event(clock.tick(step))

A step's time is measured from the end of the step before it (from the start for the first),
so what happens between steps (validation, a checkpoint save) counts where it happens: the
ETA is for the wall clock, not for the update alone."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from engine.events import RunProgress

ETA_WINDOW = 10  # steps in the moving average


def moving_average(durations, window: int = ETA_WINDOW) -> float | None:
    """Mean of the last ``window`` durations (seconds); None before the first."""
    last = list(durations)[-window:]
    return sum(last) / len(last) if last else None


def eta_seconds(durations, steps_left: int, window: int = ETA_WINDOW) -> float | None:
    """Seconds until the last step ends: moving_average(durations) x steps_left; None before
    the first step's time is known, 0 when no step is left."""
    if steps_left <= 0:
        return 0.0
    mean = moving_average(durations, window)
    return None if mean is None else mean * steps_left


class StepClock:
    """Times the steps of one run (or one resume: ``start_step`` = the checkpoint's step)."""

    def __init__(self, start_step: int, total_steps: int, window: int = ETA_WINDOW,
                 now: Callable[[], float] = time.monotonic):
        self.start_step, self.total_steps, self.window = start_step, total_steps, window
        self._now = now
        self._t0 = self._last = now()
        self.durations: deque[float] = deque(maxlen=window)

    def start(self) -> RunProgress:
        return RunProgress(step=self.start_step, total_steps=self.total_steps, start_step=self.start_step,
                           elapsed_s=0.0, step_s=None, eta_s=None)

    def tick(self, step: int) -> RunProgress:
        """Step ``step`` just ended: its time joins the average; where the run stands now."""
        t = self._now()
        self.durations.append(t - self._last)
        self._last = t
        return RunProgress(step=step, total_steps=self.total_steps, start_step=self.start_step,
                           elapsed_s=t - self._t0, step_s=moving_average(self.durations, self.window),
                           eta_s=eta_seconds(self.durations, self.total_steps - step, self.window))
