"""The live bottom of a terminal during `rl train` / `rl resume`: a step bar (step k/N, elapsed,
ETA, seconds per step, from the engine's RunProgress events) and the spinners of long phases
(model load, checkpoint save), in one rich Live display, the step rows printing above it.

On a pipe or a log file nothing here draws: the step rows (one line per step) are the
progress there, and no cursor or colour codes are written.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def clock(seconds: float | None) -> str:
    """``3725.2`` -> ``1:02:05``; None -> ``-:--:--`` (not known yet)."""
    if seconds is None:
        return "-:--:--"
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def per_step(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds:.2f} s/step" if seconds < 60 else f"{clock(seconds)}/step"


class LiveArea:
    """One rich Live display for everything that redraws (rich allows one per console): it runs
    while any of its progress displays has a task, and is erased when it stops (transient), so
    what stays on the screen is the rows and tables printed above it."""

    def __init__(self, console: Console):
        self.console = console
        self.enabled = console.is_terminal
        self.parts: list[Progress] = []
        self.live: Live | None = None

    def progress(self, *columns) -> Progress:
        p = Progress(*columns, console=self.console, auto_refresh=False)
        self.parts.append(p)
        return p

    @property
    def active(self) -> bool:
        return self.live is not None

    def refresh(self) -> None:
        """Start, redraw or stop the display after a change to a part."""
        if not self.enabled:
            return
        busy = any(p.tasks for p in self.parts)
        if busy and self.live is None:
            self.live = Live(Group(*self.parts), console=self.console, transient=True, refresh_per_second=4)
            self.live.start()
        if self.live is not None:
            if busy:
                self.live.refresh()
            else:
                self.close()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


class StepBar:
    """``⠋ step 12/40 ━━━━━━━╸━━━━━━━━━━ elapsed 0:01:05  ETA 0:02:31  5.41 s/step``"""

    def __init__(self, area: LiveArea, enabled: bool = True):
        self.area = area
        self.enabled = enabled and area.enabled
        self.progress = area.progress(
            SpinnerColumn(), TextColumn("[bold]step {task.fields[step]}/{task.fields[of]}"),
            BarColumn(bar_width=30), TextColumn("elapsed {task.fields[elapsed]}"),
            TextColumn("ETA {task.fields[eta]}"), TextColumn("[dim]{task.fields[rate]}"))
        self.task = None

    def update(self, e) -> None:
        """A RunProgress event: where the run stands after a step (or before the first)."""
        if not self.enabled:
            return
        fields = dict(step=e.step, of=e.total_steps, elapsed=clock(e.elapsed_s), eta=clock(e.eta_s),
                      rate=per_step(e.step_s))
        if self.task is None:
            self.task = self.progress.add_task("steps", total=e.total_steps, completed=e.step, **fields)
        else:
            self.progress.update(self.task, total=e.total_steps, completed=e.step, **fields)
        self.area.refresh()

    def close(self) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None
            self.area.refresh()


def phase_progress(area: LiveArea) -> Progress:
    """The spinners of long phases: ``⠋ save checkpoint step_20: 1.2 MiB written 0:00:01``."""
    return area.progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
