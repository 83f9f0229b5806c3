"""Rich tables for `rl inspect-ckpt`, drawn from the engine's report objects only.

Each function takes a report from :mod:`engine.inspect.report` and prints it; everything
shown is a field of that report, so ``--json`` (the report's ``to_json()``) carries the
same facts.
"""

from __future__ import annotations

from typing import Iterable, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.checkpoint.io.files import human_bytes

MAX_ROWS = 40  # per table; --json has them all
MAX_NAMES = 5  # names listed inline in a coverage row


def _names(names: Iterable[str], limit: int = MAX_NAMES) -> str:
    names = list(names)
    s = ", ".join(names[:limit])
    return s + (f", … (+{len(names) - limit})" if len(names) > limit else "")


def _dtype_mix(dtypes: dict[str, int]) -> str:
    return ", ".join(f"{d} ×{n}" for d, n in sorted(dtypes.items(), key=lambda x: (-x[1], x[0])))


def _more(table: Table, total: int, shown: int, what: str) -> None:
    if total > shown:
        table.caption = f"{total - shown} more {what} not shown (use --json or --keys)"


def render_checkpoint(rep, console: Console, keys: Optional[str] = None) -> None:
    """Summary, files, groups, optimizer coverage, config check, notes [, tensor rows]."""
    summary = Table(title="Checkpoint", show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("path", rep.path)
    summary.add_row("format", f"{rep.format}: {rep.format_detail}" if rep.format_detail else rep.format)
    summary.add_row("step", "-" if rep.step is None else str(rep.step))
    layout = ", ".join(f"{k}={v}" for k, v in rep.layout.items())
    summary.add_row("world size", ("-" if rep.world_size is None else str(rep.world_size))
                    + (f"  ({layout})" if layout else ""))
    if rep.complete:
        summary.add_row("status", "[green]complete[/]")
    else:
        summary.add_row("status", "[red]INCOMPLETE[/]: " + "; ".join(rep.incomplete_reasons))
    summary.add_row("on disk", f"{human_bytes(rep.total_bytes)} in {len(rep.files)} files")
    if rep.verification is not None:
        v = rep.verification
        style = "yellow" if v.get("legacy") else "green"
        summary.add_row("verified", f"[{style}]{escape(str(v.get('summary', '')))}[/]")
    for k, v in rep.info.items():
        if isinstance(v, (str, int, float)) or (isinstance(v, list) and len(v) <= 4):
            summary.add_row(k.replace("_", " "), str(v))
        elif isinstance(v, dict) and len(v) <= 6:
            summary.add_row(k.replace("_", " "), ", ".join(f"{a}={b}" for a, b in v.items()))
    if rep.versions:
        summary.add_row("versions", ", ".join(f"{k} {v}" for k, v in rep.versions.items()))
    if rep.config is not None:
        sections = [k for k, v in rep.config.items() if isinstance(v, dict)]
        summary.add_row("saved config", f"{len(rep.config)} top-level keys"
                        + (f" (sections: {', '.join(sections)})" if sections else "")
                        + " — full config in --json")
    if rep.config_check:
        summary.add_row("config check", rep.config_check)
    console.print(summary)

    files = Table(title="Files", title_justify="left")
    files.add_column("file")
    files.add_column("bytes", justify="right")
    files.add_column("size", justify="right")
    for f in rep.files[:MAX_ROWS]:
        files.add_row(f.path, f"{f.bytes:,}", human_bytes(f.bytes))
    files.add_row("[bold]total[/]", f"[bold]{rep.total_bytes:,}[/]",
                  f"[bold]{human_bytes(rep.total_bytes)}[/]")
    _more(files, len(rep.files), min(len(rep.files), MAX_ROWS), "files")
    console.print(files)

    groups = Table(title="Contents by group", title_justify="left")
    for col, just in (("group", "left"), ("tensors", "right"), ("elements", "right"),
                      ("bytes", "right"), ("dtypes", "left"), ("other entries", "right")):
        groups.add_column(col, justify=just)
    gs = rep.groups()
    for g in gs:
        groups.add_row(g.group, f"{g.tensors:,}", f"{g.elements:,}", human_bytes(g.bytes),
                       _dtype_mix(g.dtypes), f"{g.objects:,}")
    groups.add_row("[bold]total[/]", f"[bold]{sum(g.tensors for g in gs):,}[/]",
                   f"[bold]{sum(g.elements for g in gs):,}[/]",
                   f"[bold]{human_bytes(sum(g.bytes for g in gs))}[/]", "",
                   f"[bold]{sum(g.objects for g in gs):,}[/]")
    console.print(groups)

    if rep.optimizer is not None:
        render_coverage(rep.optimizer, console)
    if rep.config_issues:
        t = Table(title="Config keys removed or renamed since this checkpoint", title_justify="left")
        for col in ("saved key", "now", "why", "saved value"):
            t.add_column(col)
        for c in rep.config_issues:
            t.add_row(c.key, c.replacement or "[dim](removed)[/]", c.reason, repr(c.saved_value))
        console.print(t)
    if keys is not None:
        render_tensors(rep.select(keys), console, title=f"Tensors matching {keys!r}")
    for n in rep.notes:
        console.print(f"[dim]note:[/] {n}")


def render_coverage(cov, console: Console) -> None:
    t = Table(title=f"Optimizer coverage ({cov.source}; state: {', '.join(cov.state_names) or 'none'})",
              title_justify="left")
    t.add_column("parameters")
    t.add_column("count", justify="right")
    t.add_column("which")
    t.add_row("with full state", str(len(cov.full)), "")
    if cov.partial:
        t.add_row("[yellow]with partial state[/]", str(len(cov.partial)),
                  _names(f"{k} (no {', '.join(v)})" for k, v in cov.partial.items()))
    if cov.manifest:
        t.add_row("no state, expected (rl resume backfills)", str(len(cov.none_expected)),
                  _names(cov.none_expected))
    style = "[red]" if cov.none_unexpected else ""
    t.add_row(f"{style}no state, unexpected{'[/]' if style else ''}",
              str(len(cov.none_unexpected)), _names(cov.none_unexpected))
    style = "[red]" if cov.orphans else ""
    t.add_row(f"{style}orphan entries (no such parameter){'[/]' if style else ''}",
              str(len(cov.orphans)),
              f"{len(cov.orphans)} entries for: {_names(cov.orphan_params)}" if cov.orphans else "")
    t.caption = (f"{cov.params} trainable parameters (per the manifest)" if cov.manifest
                 else f"{cov.params} parameters (no manifest: all count as trainable)")
    console.print(t)


def render_tensors(tensors, console: Console, title: str) -> None:
    t = Table(title=title, title_justify="left")
    for col, just in (("name", "left"), ("group", "left"), ("dtype", "left"), ("shape", "left"),
                      ("elements", "right"), ("bytes", "right"), ("shards", "right"),
                      ("placement", "left")):
        t.add_column(col, justify=just)
    for x in tensors:
        t.add_row(x.name, x.group, x.dtype, str(list(x.shape)), f"{x.numel:,}",
                  human_bytes(x.nbytes), str(x.shards), x.placement)
    console.print(t)


def render_run(run, console: Console) -> None:
    """Every step of a run root: status, size, latest."""
    t = Table(title=f"{run.format}: {run.path}", title_justify="left")
    for col, just in (("checkpoint", "left"), ("step", "right"), ("status", "left"),
                      ("size", "right"), ("files", "right"), ("samples", "right"),
                      ("created", "left"), ("why not usable", "left")):
        t.add_column(col, justify=just)
    for s in run.steps:
        if s.complete and not s.reason:
            status = "[green]complete[/]"
        elif s.complete:
            status = "[red]corrupt[/]"
        else:
            status = "[yellow]incomplete[/]"
        if s.latest:
            status += " [bold](latest)[/]"
        if s.verification is not None:
            status += " [green]verified[/]" if not s.verification.get("legacy") else " [yellow]sizes only[/]"
        t.add_row(s.name, "-" if s.step is None else str(s.step), status, human_bytes(s.bytes),
                  str(s.files), "-" if s.samples_seen is None else f"{s.samples_seen:,}",
                  s.created or "-", s.reason)
    console.print(t)
    console.print(f"latest: [bold]{run.latest or 'none'}[/]   total on disk: "
                  f"{human_bytes(run.total_bytes)}")
    if run.info:
        console.print("run: " + ", ".join(f"{k}={v}" for k, v in run.info.items()))
    if run.versions:
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in run.versions.items()))
    if run.files:
        console.print("run files: " + ", ".join(f"{f.path} ({human_bytes(f.bytes)})" for f in run.files))
    for n in run.notes:
        console.print(f"[dim]note:[/] {n}")


def render_diff(d, console: Console) -> None:
    """What changed between two checkpoints."""
    head = (f"{d.a} ({d.a_format}, step {d.a_step if d.a_step is not None else '-'}) → "
            f"{d.b} ({d.b_format}, step {d.b_step if d.b_step is not None else '-'})")
    console.print(f"[bold]diff[/] {head}")
    console.print(f"tensors: {len(d.added)} added, {len(d.removed)} removed, "
                  f"{len(d.shape_changed)} reshaped, {len(d.dtype_changed)} re-typed, "
                  f"{d.unchanged} unchanged; other entries: {len(d.objects_added)} added, "
                  f"{len(d.objects_removed)} removed; config: {len(d.config_changed)} changed")
    if d.added:
        render_tensors(d.added[:MAX_ROWS], console, f"Added ({len(d.added)})")
    if d.removed:
        render_tensors(d.removed[:MAX_ROWS], console, f"Removed ({len(d.removed)})")
    for title, rows in (("Shape changed", d.shape_changed), ("Dtype changed", d.dtype_changed),
                        ("Config changed", d.config_changed)):
        if rows:
            t = Table(title=f"{title} ({len(rows)})", title_justify="left")
            t.add_column("name")
            t.add_column("before")
            t.add_column("after")
            for c in rows[:MAX_ROWS]:
                t.add_row(c.name, c.before, c.after)
            _more(t, len(rows), min(len(rows), MAX_ROWS), "rows")
            console.print(t)
    if d.objects_added:
        console.print("other entries added: " + _names(d.objects_added, 20))
    if d.objects_removed:
        console.print("other entries removed: " + _names(d.objects_removed, 20))
    if d.identical_layout:
        console.print("[green]same tensor layout[/] (names, shapes and dtypes all match)")
