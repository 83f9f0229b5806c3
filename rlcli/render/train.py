"""Rich rendering of a run: the resolved plan, one row per step, the final summary."""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

STEP_COLUMNS = [  # header, width, getter
    ("step", 5, lambda r: f"{r.step}"),
    ("reward", 7, lambda r: f"{r.reward_mean:.3f}"),
    ("acc", 6, lambda r: "-" if r.accuracy is None else f"{r.accuracy:.2f}"),
    ("kl", 7, lambda r: "-" if r.kl is None else f"{r.kl:.4f}"),
    ("pg_loss", 8, lambda r: f"{r.pg_loss:+.4f}"),
    ("entropy", 7, lambda r: "-" if r.entropy is None else f"{r.entropy:.3f}"),
    ("resp_len", 8, lambda r: f"{r.response_len_mean:.1f}"),
    ("roll tok/s", 10, lambda r: f"{r.rollout_tokens_per_s:,.0f}"),
    ("upd tok/s", 10, lambda r: f"{r.update_tokens_per_s:,.0f}"),
    ("pad%", 5, lambda r: f"{100 * r.pad_fraction:.0f}"),
    ("step s", 6, lambda r: f"{r.step_time_s:.2f}"),
    ("peak mem", 9, lambda r: human_bytes(r.peak_mem_bytes)),
    ("rfail", 5, lambda r: str(r.reward_failures) if getattr(r, "reward_failures", 0) else "-"),
    ("val", 6, lambda r: "" if r.val_accuracy is None and r.val_reward is None
     else f"{r.val_accuracy if r.val_accuracy is not None else r.val_reward:.2f}"),
]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def plan_table(plan) -> Table:
    t = Table(title="rl train", show_header=False, title_justify="left", title_style="bold")
    t.add_column(style="cyan", no_wrap=True)
    t.add_column()
    t.add_row("engine", f"{plan.engine}  ({plan.ranks} rank{'s' if plan.ranks > 1 else ''}, dp={plan.dp_size}, "
                        f"{plan.device})")
    t.add_row("model", Text(f"{plan.model}  ({plan.num_params:,} params)"))  # paths: never read as markup
    t.add_row("task", f"{plan.task}  ({plan.num_train} train / {plan.num_val} held-out prompts)")
    if getattr(plan, "data", ""):
        t.add_row("data", plan.data)
    if getattr(plan, "reward", ""):
        t.add_row("reward", plan.reward)
    t.add_row("rollout", plan.rollout)
    t.add_row("steps", f"{plan.start_step + 1} .. {plan.total_steps}")
    for k, v in plan.key_settings.items():
        mark = "  [yellow](changed)[/]" if k in plan.changed else ""
        t.add_row(k, f"{v}{mark}")
    before = "was" if plan.changed_from == "checkpoint" else "default"
    for k, (old, new) in plan.changed.items():
        if k not in plan.key_settings:
            t.add_row(k, f"{new}  [yellow]({before} {old})[/]")
    t.add_row("run dir", Text(str(plan.run_dir)))  # checkpoint.dir="runs/[a]" is a path, not markup
    waits = sorted({str(p.get("omp_wait", "")) for p in plan.placement or []} - {""})
    if waits and str(plan.device).startswith("cpu"):
        t.add_row("openmp waits", ", ".join(waits) + "  (trainer.omp_wait)")
    if plan.ray:
        nodes = sorted({p["node_ip"] for p in plan.placement})
        t.add_row("ray", plan.ray + (f"  (ranks on {len(nodes)} nodes: {', '.join(nodes)})" if len(nodes) > 1 else ""))
    return t


class StepPrinter:
    """Prints one aligned row per step (works in terminals and in logs/pipes). While a live
    display (the step bar, rlcli/render/progress.py) runs, rows go through its console, above it."""

    def __init__(self, console: Console, log_freq: int = 1, enabled: bool = True, area=None):
        # rows need ~124 columns; logs and pipes default to 80, so widen rather than squeeze
        self.console = Console(file=console.file, width=max(console.width, 124), highlight=False,
                               force_terminal=console.is_terminal, no_color=console.no_color)
        self.log_freq = log_freq
        self.enabled = enabled  # "console" in trainer.loggers
        self.rows = 0
        self.area = area  # rlcli.render.progress.LiveArea, or None

    def _print(self, renderable) -> None:
        if self.area is not None and self.area.active:  # the live display's console keeps it below
            with self.console.capture() as cap:  # drawn at the rows' width, as without the display
                self.console.print(renderable)
            self.area.console.print(Text.from_ansi(cap.get().rstrip("\n")), soft_wrap=True)
        else:
            self.console.print(renderable)

    def _table(self, header: bool) -> Table:
        t = Table(box=None, show_header=header, header_style="bold", pad_edge=False, padding=(0, 1))
        for name, width, _ in STEP_COLUMNS:
            t.add_column(name, width=width, justify="right", no_wrap=True)
        return t

    def step(self, rec) -> None:
        if not self.enabled:
            return
        alarms = getattr(rec, "alarms", None) or []
        if rec.step % self.log_freq and rec.checkpoint is None and rec.val_accuracy is None and not alarms:
            return
        t = self._table(header=self.rows % 25 == 0)
        t.add_row(*[get(rec) for _, _, get in STEP_COLUMNS])
        self._print(t)
        self.rows += 1
        for a in alarms:
            self._print(f"  [bold red]ALARM[/] {a['kind']} (step {a['step']}): {a['message']}")

    def validation(self, v) -> None:
        if not self.enabled:
            return
        acc = "-" if v.accuracy is None else f"{v.accuracy:.3f}"
        failed = f", {v.reward_failures} reward calls failed (scored 0)" if getattr(v, "reward_failures", 0) else ""
        self._print(f"  [bold]validation[/] step {v.step}: accuracy {acc}, reward {v.reward:.3f}{failed}")


def summary_table(s) -> Table:
    t = Table(title="summary", show_header=False, title_justify="left", title_style="bold")
    t.add_column(style="cyan", no_wrap=True)
    t.add_column()
    t.add_row("steps", f"{s.first_step} .. {s.last_step} ({s.steps_run} run)")
    t.add_row("reward, first 10 steps", f"{s.reward_first10:.3f}")
    ratio = f"  ([bold]{s.improvement:.1f}x[/])" if s.improvement is not None else ""
    t.add_row("reward, last 10 steps", f"{s.reward_last10:.3f}{ratio}")
    lag = getattr(s, "versions_ahead", 0)
    if lag:  # a step's reward is of a batch sampled by older weights than a sync run's at that step
        t.add_row("samples", Text(f"up to {lag} update{'s' if lag > 1 else ''} behind the weights that trained on "
                                  f"them; beside a sync run: rl plot {s.run_dir} SYNC_RUN --x version"))
    if s.val_before is not None or s.val_after is not None:
        t.add_row("held-out, before -> after", f"{_f(s.val_before)} -> {_f(s.val_after)}")
    alarms = getattr(s, "alarms", None) or []
    if alarms:
        t.add_row("[red]alarms[/]", "\n".join(f"step {a['step']}: {a['kind']}" for a in alarms))
    if getattr(s, "stopped_by_alarm", None):
        t.add_row("[red]stopped[/]", f"by the {s.stopped_by_alarm} alarm (trainer.stop_on_alarm=true)")
    t.add_row("wall time", f"{s.wall_time_s:.1f} s")
    t.add_row("metrics", Text(str(s.metrics_path)))  # paths under checkpoint.dir: never read as markup
    for name, where in (s.tracking or {}).get("where", {}).items():
        if name != "jsonl":
            t.add_row(name, Text(str(where)))
    t.add_row("checkpoints", Text("\n".join(s.checkpoints)) if s.checkpoints else "none")
    return t


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


class PhaseDisplay:
    """Long phases (model load, checkpoint save/load, validation): a live spinner with bytes and
    elapsed time on a terminal; on a pipe or log, one plain line when each phase ends."""

    DONE_VERB = {"load_model": "ready", "load_checkpoint": "loaded", "save_checkpoint": "saved",
                 "validation": "done"}

    def __init__(self, console: Console, area=None):
        from rlcli.render.progress import LiveArea, phase_progress

        self.console = console
        self.area = area if area is not None else LiveArea(console)  # shared with the step bar
        self.live = self.area.enabled
        self.progress: Progress = phase_progress(self.area)
        self.tasks: dict[str, tuple] = {}   # phase -> (task id, label, total bytes)

    def started(self, e) -> None:
        if not self.live:
            return
        label = e.label + (f" ({human_bytes(e.total_bytes)})" if e.total_bytes else "")
        self.tasks[e.phase] = (self.progress.add_task(label, total=None), e.label, e.total_bytes)
        self.area.refresh()

    def update(self, e) -> None:
        if e.phase not in self.tasks:
            return
        task, label, _ = self.tasks[e.phase]
        self.progress.update(task, description=f"{label}: {human_bytes(e.done_bytes)} written")
        self.area.refresh()

    def finished(self, e) -> None:
        if e.phase in self.tasks:
            task, _, _ = self.tasks.pop(e.phase)
            self.progress.remove_task(task)
            self.area.refresh()
        if e.phase == "validation":
            return  # its result is printed on its own line / in the step row
        size = f", {human_bytes(e.bytes)}" if e.bytes else ""
        what = e.label.removeprefix("save checkpoint ") if e.phase == "save_checkpoint" else e.label
        self.console.print(Text(f"  {self.DONE_VERB.get(e.phase, 'done')}: {what} ({e.seconds:.1f} s{size})",
                                style="dim"))

    def close(self) -> None:
        for task, _, _ in self.tasks.values():
            self.progress.remove_task(task)
        self.tasks = {}
        self.area.close()


def summary_chart(run_dir: str, console: Console) -> Text | None:
    """The reward curve (and the validation curve when the run validated) under the summary."""
    from engine.errors import UserError
    from engine.tracking.series import load_series

    try:
        series = [load_series(run_dir, "train/reward")]
    except UserError:
        return None  # no metrics.jsonl (trainer.loggers without jsonl)
    charts = []
    from rlcli.render.plot import terminal_chart

    width = min(max(console.width, 40), 100)
    color = console.is_terminal and not console.no_color
    try:
        charts.append(terminal_chart(series, "train/reward", width=width, height=12, color=color))
        for name in ("val/accuracy", "val/reward"):
            try:
                val = load_series(run_dir, name)
            except UserError:
                continue
            if len(val.steps) > 1:
                charts.append(terminal_chart([val], name, width=width, height=10, color=color))
            break
    except UserError:
        return None  # plotext not installed: the table alone
    text = "\n".join(charts)
    return Text.from_ansi(text) if color else Text(text)
