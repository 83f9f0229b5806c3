"""Charts of metric series: in the terminal through plotext, as a PNG through matplotlib.

Both libraries are imported inside the functions (the `tracking` extra); a missing one is a
UserError naming the extra."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

EXTRA = "pip install 'rl[tracking]'"
# The narrowest terminal chart worth drawing: plotext's frame takes up to 9 columns (y tick labels of up
# to 7, such as -1.2e-7, and the two borders), which leaves 11 or more for the line and the x ticks. At
# 6 columns or fewer the frame alone fills the width and the chart is empty; below 20 some metrics'
# charts lose their x ticks or their title.
MIN_WIDTH = 20


def _need(module: str):
    import importlib

    from engine.errors import UserError

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"Plotting needs the `{module.split('.')[0]}` package, which is not installed. Install "
                        f"the tracking extra: `{EXTRA}`.", title="missing package") from None


def label_of(series, all_series) -> str:
    """Run label: the run directory, shortened to its last parts when that stays unique."""
    names = [Path(s.run).resolve() for s in all_series]
    for depth in (1, 2, 3):
        short = ["/".join(p.parts[-depth:]) for p in names]
        if len(set(short)) == len(short):
            return short[all_series.index(series)]
    return series.run


# Values drawn are kept within +-DRAW_LIMIT: a series spanning e.g. -1e308..1e308 (a diverged run's
# grad_norm) overflows the axis span to inf, and plotext / matplotlib then fail computing ticks
# (a traceback from `rl plot`). --json keeps the logged values.
DRAW_LIMIT = 1e150


def _drawable(values: list) -> list[float]:
    return [_clamped(v) for v in values]


def _clamped(v) -> float:
    try:
        f = float(v)
    except OverflowError:  # an int beyond any float (a step of 10**400 in a damaged row)
        f = DRAW_LIMIT if v > 0 else -DRAW_LIMIT
    return min(max(f, -DRAW_LIMIT), DRAW_LIMIT)


def thinned(steps: list, values: list, buckets: int) -> tuple[list, list]:
    """At most ~2 x ``buckets`` points for a terminal chart: the series cut into ``buckets``
    runs of consecutive points, each kept as its lowest and highest point (in step order), so
    spikes stay visible (and the first and last points, so the x axis spans the run). A terminal chart has only a few cells per column, and plotext drawing
    every point of a long run (100k steps) took ~700 MB and seconds; --json and --png keep all."""
    n = len(steps)
    if n <= 2 * buckets:
        return list(steps), list(values)
    xs, ys = [], []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        seg = range(lo, hi)
        keep = sorted({min(seg, key=lambda i: values[i]), max(seg, key=lambda i: values[i])}
                      | ({0} if b == 0 else set()) | ({n - 1} if b == buckets - 1 else set()))
        xs += [steps[i] for i in keep]
        ys += [values[i] for i in keep]
    return xs, ys


# One marker per run when colour cannot tell the runs apart (no colour, or the legend under the
# chart): plotext's own legend samples are all its default marker. "hd" is plotext's default (▚).
MARKERS = ("hd", "x", "+", "o", "*", "#", "@", "%", "=", "~")


def legend_fits(runs: int, height: int) -> bool:
    """Whether plotext's legend box (two rows a run, inside the plot) fits a chart ``height``
    rows high. Beyond that plotext dropped it without a word (7 runs at the default height: 7
    unlabelled lines) or drew it across the x axis."""
    return runs <= (height - 7) // 2


def _x_label(series: list) -> str:
    from engine.tracking.series import X_LABELS

    axis = series[0].x_axis if series else "step"
    return X_LABELS.get(axis, axis)


def terminal_chart(series: list, title: str, *, width: int = 72, height: int = 16, color: bool = True) -> str:
    """A line per series, drawn by plotext; ANSI colours only when ``color``. Several runs: a
    legend in the chart when it fits, else one line under it (each run with its own marker)."""
    plt = _need("plotext")
    fig = plt.figure
    fig.clear()
    fig.plot_size(width, height)
    fig.theme("dark" if color else "colorless")
    several = len(series) > 1
    inside = not several or legend_fits(len(series), height)
    below = []
    for i, s in enumerate(series):
        steps, values = thinned(s.x, s.values, max(width, 1) * 2)
        marker = MARKERS[i % len(MARKERS)] if several and (not color or not inside) else None
        sig = fig.signal(_drawable(steps), _drawable(values), marker=marker)
        sig.lines()
        label = label_of(s, series) if several else s.metric
        if inside and (several or s.metric != title):
            sig.label(label)
        elif not inside:
            below.append(f"{'▚' if marker == 'hd' else marker} {label}")
        fig.draw(sig)
    fig.title(title)
    fig.label(_x_label(series), axis="x")
    chart = fig.build().string(colorless=not color)
    return chart + ("\n" + "   ".join(below) if below else "")


def png_chart(series: list, title: str, out: Path) -> Path:
    """Write a PNG (atomically: temp file + rename) with one line per series; returns its path."""
    matplotlib = _need("matplotlib")
    matplotlib.use("Agg", force=True)
    fig = png_figure(series, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=120)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp's 0600 -> what a plain open would give
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        import matplotlib.pyplot as plt

        plt.close(fig)
    return out


def png_figure(series: list, title: str):
    _need("matplotlib")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in series:
        ax.plot(_drawable(s.x), _drawable(s.values), marker="." if len(s.steps) < 60 else None,
                label=label_of(s, series) if len(series) > 1 else s.metric)
    ax.set_title(title)
    ax.set_xlabel(_x_label(series))
    ax.set_ylabel(series[0].metric if series else "")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    return fig
