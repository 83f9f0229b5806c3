"""Metric series read back from run directories, for `rl plot` and the end-of-run chart.

``train/``, ``perf/``, ``mem/`` metrics come from metrics.jsonl, ``val/`` metrics from
validation.jsonl (which includes the step-0 "before" validation). When a step appears more
than once (rows of an abandoned segment before a resume), its last row wins.

Each point also has an x position on one of three axes (:data:`X_AXES`):

- ``step``: the step number;
- ``version``: the policy version whose weights the point reflects. A step's metrics come from
  a batch, and a batch was sampled by the weights after some number of updates: step k of a
  synchronous run by version k-1, of a one_step_off run by version k-2 (its ``async/`` row says
  so: ``policy_version`` minus the batch's mean ``staleness``). A validation after step s reads
  version s. On this axis a run that samples ahead and a synchronous one are compared by policy
  rather than by batch: at the same step, one_step_off's reward is of a policy one update older;
- ``time``: training time, the sum of the steps' ``step_time_s`` through that step (validation,
  checkpoint saves and start-up not counted), to compare modes by what a step costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from engine.checkpoint.layout import STEP_RE
from engine.errors import UserError
from engine.tracking.names import resolve_metric, step_metrics, validation_metrics

METRICS_FILE = "metrics.jsonl"
VALIDATION_FILE = "validation.jsonl"


X_AXES = ("step", "version", "time")
X_LABELS = {"step": "step", "version": "policy version that sampled the batch",
            "time": "training time (s, sum of step_time_s)"}
_VERSION, _STALENESS, _STEP_TIME = "async/policy_version", "async/mean", "perf/step_time_s"


@dataclass
class Series:
    run: str            # the run directory as given
    metric: str         # logged name, e.g. train/reward
    steps: list[int]
    values: list[float]
    x: list[float] | None = None  # positions on ``x_axis``; None = the steps
    x_axis: str = "step"

    def __post_init__(self):
        if self.x is None:
            self.x = list(self.steps)

    def to_json(self) -> dict:
        return asdict(self) | {"points": len(self.steps)}


def run_root(path: Path) -> Path:
    """A run directory, one of its step_N checkpoints, or its metrics.jsonl -> the run directory."""
    p = Path(path)
    if p.is_file() and p.name in (METRICS_FILE, VALIDATION_FILE):
        return p.parent
    if STEP_RE.match(p.name) and p.is_dir():
        return p.parent
    return p


def _rows(path: Path):
    """The rows with an integer step, one at a time (a long run's metrics.jsonl is never held
    whole); lines that are not JSON objects (a half-written last line of a killed run, damaged
    bytes) are skipped. A directory, FIFO or device there is a UserError, raised at the call."""
    from engine.user_paths import iter_jsonl, shown

    lines = iter_jsonl(path, shown(path))
    return (row for _, row in lines
            if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool))


def run_metrics(path: Path, only: str | None = None) -> dict[int, dict[str, float]]:
    """step -> every logged metric of that step (train/perf/mem from metrics.jsonl, val/ from
    validation.jsonl); with ``only``, just that metric (steps without it are left out), so
    plotting one metric of a long run keeps one number per step, not every row."""
    return _scan(path, only)[0]


def _scan(path: Path, only: str | None, also: tuple[str, ...] = ()) -> tuple[dict[int, dict[str, float]], set[str]]:
    """run_metrics, and the names of every metric the run has, in one pass over its files.
    ``also``: metrics of metrics.jsonl kept beside ``only`` (what an x axis is computed from)."""
    from engine.user_paths import file_kind, shown, stat_path

    st = stat_path(path, f"the run path {shown(path)}", title="no run")
    if st is None:
        raise UserError(f"{shown(path)} does not exist. Pass run directories (the checkpoint.dir of a run, e.g. "
                        f"`rl plot ckpt/`).", title="no run")
    root = run_root(path)
    if root == Path(path) and not Path(path).is_dir():
        raise UserError(f"{shown(path)} is {file_kind(st)}, not a run directory. Pass run directories (the "
                        f"checkpoint.dir of a run, e.g. `rl plot ckpt/`), a step_N directory or a {METRICS_FILE}.",
                        title="no run")
    metrics_rows, val_rows = _rows(root / METRICS_FILE), _rows(root / VALIDATION_FILE)
    by_step: dict[int, dict[str, float]] = {}
    names: set[str] = set()
    rows = 0
    for row in metrics_rows:
        rows += 1
        m = step_metrics(row)
        names.update(m)
        by_step[row["step"]] = m if only is None else {k: m[k] for k in (only, *also) if k in m}
    for row in val_rows:
        rows += 1
        m = validation_metrics(row.get("accuracy"), row.get("reward"))
        names.update(m)
        by_step.setdefault(row["step"], {}).update(m if only is None else {only: m[only]} if only in m else {})
    if not rows:
        mf = root / METRICS_FILE
        hint = (" The file holds no JSON row with a step: it is damaged, or is not a run's metrics.jsonl."
                if mf.is_file() and mf.stat().st_size > 0 else
                " The run was started with trainer.loggers without jsonl, so it kept no metrics.jsonl."
                if (root / "run.json").exists() else " It is not an rl run directory.")
        raise UserError(f"{path} has no metrics to plot (no rows in {root / METRICS_FILE}).{hint}",
                        title="no metrics")
    return by_step, names


def load_series(path: Path, metric: str, x: str = "step") -> Series:
    """One metric of a run, with each point's position on the ``x`` axis (module docstring)."""
    if x not in X_AXES:
        raise UserError(f"Unknown x axis `{x}`. Use one of: {', '.join(X_AXES)}.", title="unknown axis")
    name = resolve_metric(metric)
    by_step, names = _scan(path, name, (_VERSION, _STALENESS, _STEP_TIME) if x != "step" else ())
    steps = sorted(s for s, m in by_step.items() if name in m)
    if not steps:
        from engine.config.validate import suggest

        known = sorted(names)
        listed = f" Its metrics: {', '.join(known)}." if known else " Its rows hold no finite numbers besides the step."
        root = run_root(path)
        if not name.startswith("val/") and not (root / METRICS_FILE).exists() and (root / "run.json").exists():
            listed += (f" It has no {METRICS_FILE}, only {VALIDATION_FILE}: the run was started with trainer.loggers "
                       f"without jsonl, so only its validation (val/) metrics can be drawn; add jsonl to "
                       f"trainer.loggers (also on `rl resume`) to keep the step metrics.")
        raise UserError(f"{path} has no metric `{metric}` with a finite value (nan and inf are not drawn)."
                        f"{suggest(name, known)}{listed}", title="unknown metric")
    values = [by_step[s][name] for s in steps]
    if x == "step":
        return Series(str(path), name, steps, values)
    from_validation = name.startswith("val/")
    positions = (_versions(by_step, steps, from_validation) if x == "version"
                 else _training_times(path, by_step, steps))
    return Series(str(path), name, steps, values, positions, x)


def _versions(by_step: dict[int, dict[str, float]], steps: list[int], from_validation: bool) -> list[float]:
    """The policy version behind each point: a validation after step s reads version s; a step's
    batch was sampled by ``policy_version - mean staleness`` where the row records them (a mode
    that samples ahead), else by version step - 1 (the synchronous trainer)."""
    if from_validation:
        return [float(s) for s in steps]
    out = []
    for s in steps:
        m = by_step[s]
        out.append(m[_VERSION] - m.get(_STALENESS, 0.0) if _VERSION in m else float(s - 1))
    return out


def _training_times(path: Path, by_step: dict[int, dict[str, float]], steps: list[int]) -> list[float]:
    """Each point at the run's training time through its step: the sum of step_time_s over the
    steps up to it (validation, saves and start-up not counted). A step with no step_time_s
    (a damaged row) adds nothing; a run with none cannot be drawn on this axis."""
    timed = sorted(s for s, m in by_step.items() if _STEP_TIME in m)
    if not timed:
        raise UserError(f"{path} records no step times (perf/step_time_s), so its points have no training time. "
                        f"Draw it by step or policy version (`--x step`, `--x version`).", title="no step times")
    total, through, i = 0.0, [], 0
    for s in steps:  # both sorted: one pass
        while i < len(timed) and timed[i] <= s:
            total += by_step[timed[i]][_STEP_TIME]
            i += 1
        through.append(total)
    return through


def available_metrics(path: Path) -> list[str]:
    return sorted(_scan(path, "")[1])  # only="": no metric is kept per step, just the names
