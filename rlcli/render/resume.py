"""Rich rendering of a resume plan: what is restored, from where, and what is refused."""

from __future__ import annotations

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def _names(names: list[str], limit: int = 12) -> str:
    from engine.checkpoint.optimizer_entries import group_names

    return "\n".join(group_names(names, limit))


def _rng_rows(rng: list[dict]) -> list[str]:
    """One row per run of consecutive ranks restored the same way ("ranks 0-3: rng/rank_<r>.pt",
    "ranks 4-1023: no saved RNG ..."), so the table stays a few lines at any world size."""
    runs: list[list[dict]] = []
    for r in rng:
        same = runs and (runs[-1][0]["source"] is None) == (r["source"] is None) and runs[-1][0]["note"] == r["note"]
        if same:
            runs[-1].append(r)
        else:
            runs.append([r])
    rows = []
    for run in runs:
        first = run[0]
        if len(run) == 1:
            who, src = f"rank {first['rank']}", first["source"]
        else:
            who, src = f"ranks {first['rank']}-{run[-1]['rank']}", first["source"] and "rng/rank_<r>.pt"
        rows.append(f"{who}: {escape(src) if src else '[yellow]' + escape(first['note']) + '[/]'}")
    return rows


def resume_table(plan) -> Group:
    """The table `rl resume` prints before training continues (and for --dry-run)."""
    t = Table(title="rl resume", show_header=False, title_justify="left", title_style="bold")
    t.add_column(style="cyan", no_wrap=True)
    t.add_column()
    t.add_column(style="dim")
    t.add_row("checkpoint", f"{plan.step_dir}", f"written {plan.created}")
    v = plan.verification or {}
    if v:
        summary = escape(str(v.get("summary", "")))
        if v.get("legacy"):
            t.add_row("verified", f"[yellow]{summary}[/]", "manifest.json (version 1)")
        elif not v.get("content"):
            t.add_row("verified", f"[bold red]{summary}[/]", "--no-verify")
        else:
            t.add_row("verified", f"[green]{summary}[/]", "manifest.json hashes + cross-checks")
    for name in plan.skipped:
        t.add_row("", f"[yellow]skipped {name}[/]", "incomplete (no manifest.json): never resumed")
    runs = f"runs {plan.step + 1} .. {plan.total_steps}" if plan.total_steps > plan.step else \
        f"[red]nothing left to run (trainer.total_steps={plan.total_steps})[/]"
    t.add_row("step", f"{plan.step}  ->  {runs}", "trainer.json")
    t.add_row("samples seen", f"{plan.samples_seen:,}", "trainer.json")
    m = plan.model
    t.add_row("model", f"{m.get('path') or m.get('preset')}  ({(m.get('num_params') or 0):,} params, "
                       f"{m.get('tensors')} tensors)", "state/ (DCP)")
    opt = plan.optimizer
    t.add_row("optimizer", f"{len(opt.loaded)} parameters loaded", "state/ (DCP, flattened AdamW)")
    if opt.backfilled:
        t.add_row("", f"[yellow]{len(opt.backfilled)} backfilled[/] (no gradient yet at step {plan.step}: "
                      f"initial AdamW state)\n{_names(opt.backfilled)}", "manifest: param_state false")
    if opt.missing:
        if plan.allow_partial:
            t.add_row("", f"[bold red]{len(opt.missing)} MISSING, backfilled by --allow-partial[/] (moments restart "
                          f"from zero)\n[red]{_names(opt.missing)}[/]", "manifest says they had state")
        else:
            t.add_row("", f"[bold red]{len(opt.missing)} missing (refused)[/]\n[red]{_names(opt.missing)}[/]",
                      "manifest says they had state")
    lr = plan.lr_scheduler
    t.add_row("LR scheduler", f"last_epoch {lr.get('last_epoch')}, lr {lr.get('last_lr')}", "trainer.json")
    for i, row in enumerate(_rng_rows(plan.rng)):
        t.add_row("RNG" if i == 0 else "", row, "torch, cuda, python, numpy, sampler")
    d = plan.data
    t.add_row("data", f"epoch {d.get('epoch')}, prompt {d.get('index')} / {d.get('n')}", "trainer.json")
    ws = f"{plan.world_size_then} -> {plan.world_size_now}"
    t.add_row("world size", ws if plan.world_size_then == plan.world_size_now else f"[yellow]{ws}[/] (DCP reshards)",
              f"saved layout {plan.parallel_then}")
    t.add_row("metrics", f"{plan.metrics_rows_dropped} row(s) after step {plan.step} dropped"
              if plan.metrics_rows_dropped else "kept", "metrics.jsonl")
    parts = [t]

    if plan.config_changes:
        c = Table(title="config changes (checkpoint -> now)", title_justify="left")
        c.add_column("key", style="cyan")
        c.add_column("then")
        c.add_column("now")
        c.add_column("")
        c.add_column("why", style="dim")
        for ch in plan.config_changes:
            mark = "[green]allowed[/]" if ch.allowed else "[bold red]refused[/]"
            c.add_row(ch.key, str(ch.then), str(ch.now), mark, ch.reason)
        parts.append(c)
    for w in plan.warnings:
        style = "bold red" if w.startswith(("--allow-partial", "--no-verify")) else "yellow"
        parts.append(Text(f"! {w}", style=style))
    return Group(*parts)
