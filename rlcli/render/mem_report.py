"""Rich tables for `rl mem-report`, drawn only from the engine's MemoryReport.

Everything shown is a field of the report (``--json`` prints ``report.to_json()``): the
summary, estimate beside measured per phase x category (or the estimate alone), measured
figures per phase, the offload what-if matrix, FP8 workspaces cleared, the top fixes, notes.
"""

from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlcli.render.train import human_bytes

CATEGORY_LABELS = {"params": "params", "grads": "grads", "optimizer": "optimizer", "activations": "activations",
                   "activations_host": "activations on host", "logits": "logits", "fp8_workspaces": "FP8 workspaces", "kv_cache": "KV cache"}
MAX_MEASURED_ROWS = 32  # per-rank x phase rows; --json has them all


def _b(n: Optional[int]) -> str:
    return "-" if n is None else human_bytes(n)


def _diff(pct: Optional[float]) -> str:
    if pct is None:
        return ""
    colour = "green" if abs(pct) <= 10 else "yellow" if abs(pct) <= 25 else "red"
    return f"[{colour}]{pct:+.1f}%[/]"


def _verdict(fits: Optional[bool]) -> str:
    return "[dim]unknown[/]" if fits is None else "[green]fits[/]" if fits else "[red]doesn't fit[/]"


def _table(title: str, **kw) -> Table:
    """A table whose title stays on one line (rich wraps titles to the table's width)."""
    return Table(title=title, title_justify="left", min_width=len(title), **kw)


def render_report(rep, console: Console) -> None:
    console.print(summary_table(rep))
    if rep.comparison:
        console.print(comparison_table(rep))
    elif rep.estimate is not None:
        console.print(estimate_table(rep.estimate))
    if rep.measured:
        console.print(measured_table(rep))
    if rep.estimate is not None:
        console.print(whatif_table(rep.estimate))
    console.print(fp8_table(rep))
    if rep.estimate is not None:
        console.print(fixes_table(rep.estimate))
    notes = list(getattr(rep, "notes", []) or []) + (list(rep.estimate.notes) if rep.estimate else [])
    for n in notes:  # notes name paths and overrides: shown as they are, never read as markup
        console.print(f"[dim]note:[/] {escape(str(n))}")


def summary_table(rep) -> Table:
    t = Table(title="rl mem-report", show_header=False, title_justify="left", title_style="bold", box=None,
              pad_edge=False)
    t.add_column(style="cyan", no_wrap=True)
    t.add_column()
    t.add_row("source", escape(str(rep.source)))  # the run directory as given: `runs/[a]` is not markup
    est = rep.estimate
    if est is not None:
        lay = est.layout
        par = ", ".join(f"{k}={lay[k]}" for k in ("dp", "tp", "pp", "cp") if lay.get(k, 1) != 1 or k == "dp")
        t.add_row("model", f"{escape(str(est.model))}  ({est.param_count:,} params, {human_bytes(est.model_bytes)} "
                           f"in {est.dtype})")
        t.add_row("layout", f"{est.backend}, {lay['nprocs']} rank{'s' if lay['nprocs'] > 1 else ''} ({par})")
        moe = getattr(est, "moe", None)
        if moe:
            share = moe["expert_params"] / max(1, est.param_count)
            t.add_row("experts", f"{moe['experts_per_layer']} per layer x {moe['moe_layers']} MoE layers, top-"
                                 f"{moe['top_k']}; {moe['expert_params']:,} expert params ({share:.0%}), "
                                 f"{moe['router_params']:,} router params")
            t.add_row("routing records", f"int16 \\[tokens, {moe['moe_layers']}, {moe['top_k']}]: "
                                         f"{human_bytes(moe['routing_bytes_rollout_batch'])} per rank's rollout batch "
                                         f"(host), {human_bytes(moe['routing_bytes_micro_batch'])} per micro-batch "
                                         f"(device, replay) — algorithm.router_replay={moe['router_replay']}")
        a = est.assumptions
        basis = getattr(rep, "seq_len_source", "")
        basis = {"kv_cache": " (the run's, from its KV cache)", "metrics": " (the run's micro-batches)",
                 "config": " (config limit)"}.get(basis, "")
        t.add_row("shapes", f"sequence {a['seq_len']} tokens{basis}; micro-batch {a['micro_batch_sequences']} x "
                            f"{a['seq_len']} = {a['micro_batch_tokens']:,} tokens; rollout "
                            f"{a['rollout_sequences_at_once']} sequences at once")
        dev = est.device_memory_bytes
        t.add_row("device", human_bytes(dev) if dev else "unknown (give --device-memory)")
        t.add_row("estimated peak", f"[bold]{human_bytes(est.peak_bytes)}[/] per rank in {est.peak_phase}"
                                    + (f"  {_verdict(est.peak_bytes <= dev)}" if dev else ""))
        w = getattr(est, "rollout_worker", None)
        if w:  # trainer.mode samples ahead: a process of its own, on its own GPU or rank 0's
            shared = w["rank0_peak_if_shared"]
            t.add_row("rollout worker", f"{human_bytes(w['total'])} (policy {human_bytes(w['params'])}, KV cache "
                                        f"{human_bytes(w['kv_cache'])}, logits {human_bytes(w['logits'])}); on rank "
                                        f"0's device it makes rank 0's peak {human_bytes(shared)}"
                                        + (f"  {_verdict(shared <= dev)}" if dev else ""))
    if rep.measured:
        ranks = sorted({r.rank for r in rep.measured})
        steps = rep.steps
        span = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]} .. {steps[-1]}"
        t.add_row("measured", f"step{'s' if len(steps) > 1 else ''} {span}, {len(ranks)} rank"
                              f"{'s' if len(ranks) > 1 else ''}, device {rep.measured[0].device}")
    return t


def comparison_table(rep) -> Table:
    t = _table("Estimate vs measured (rank 0, per phase x category; measured = peak over steps)")
    for name, just in (("phase", "left"), ("category", "left"), ("estimate", "right"), ("measured", "right"),
                       ("diff", "right")):
        t.add_column(name, justify=just, no_wrap=True)
    last = None
    for row in rep.comparison:
        if last is not None and row.phase != last:
            t.add_section()
        if row.measured is None:
            measured = "[dim]not run[/]"
        else:
            measured = _b(row.measured)
        t.add_row(row.phase if row.phase != last else "", CATEGORY_LABELS.get(row.category, row.category),
                  _b(row.estimate), measured, _diff(row.diff_pct))
        last = row.phase
    t.caption = ("diff = (measured - estimate) / estimate: green within 10%, yellow within 25%. "
                 "A measured 0 B: that phase held none of it, or nothing recorded it.")
    t.caption_justify = "left"
    return t


def estimate_table(est) -> Table:
    cats = [c for c in CATEGORY_LABELS if any(p.categories.get(c) for p in est.phases)]
    t = _table("Estimated device memory per rank (phase x category)")
    t.add_column("phase", no_wrap=True)
    for c in cats:
        t.add_column(CATEGORY_LABELS[c], justify="right", no_wrap=True)
    t.add_column("total", justify="right", no_wrap=True)
    for p in est.phases:
        peak = p.phase == est.peak_phase
        cells = [_b(p.categories.get(c, 0)) if p.categories.get(c) else "[dim]-[/]" for c in cats]
        total = human_bytes(p.total)
        t.add_row(f"[bold]{p.phase}[/] (peak)" if peak else p.phase, *cells, f"[bold]{total}[/]" if peak else total)
    return t


def measured_table(rep) -> Table:
    cuda = any(r.peak_allocated is not None for r in rep.measured)
    t = _table("Measured per phase (peak over steps)")
    t.add_column("rank", justify="right")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    if cuda:
        for name in ("peak allocated", "peak reserved", "device used", "outside torch"):
            t.add_column(name, justify="right")
    t.add_column("peak RSS", justify="right")
    t.add_column("host (offloaded)", justify="right")
    for r in rep.measured[:MAX_MEASURED_ROWS]:
        host = sum(v.get("offloaded", 0) for v in (r.host_offload or {}).values())
        cells = [str(r.rank), r.phase, f"{r.seconds:.2f}"]
        if cuda:
            cells += [_b(r.peak_allocated), _b(r.peak_reserved), _b(r.device_used), _b(r.non_torch)]
        cells += [_b(r.peak_rss), _b(host) if host else "[dim]-[/]"]
        t.add_row(*cells)
    if len(rep.measured) > MAX_MEASURED_ROWS:
        t.caption = f"{len(rep.measured) - MAX_MEASURED_ROWS} more rows in --json"
    elif not cuda:
        t.caption = "CPU: no allocator figures; peak RSS is the whole process (Python, torch, libraries)"
        t.caption_justify = "left"
    return t


def whatif_table(est) -> Table:
    dev = est.device_memory_bytes
    against = f"against {human_bytes(dev)}" if dev else "device size unknown: give --device-memory"
    t = _table(f"Offload what-if (per rank, {against})")
    for name, just in (("offload", "left"), ("overrides", "left"), ("device peak", "right"),
                       ("in phase", "left"), ("host", "right"), ("verdict", "left"), ("headroom", "right")):
        t.add_column(name, justify=just, no_wrap=name != "overrides")
    for w in est.offload_matrix:
        head = "" if w.headroom_bytes is None else (("+" if w.headroom_bytes >= 0 else "-")
                                                   + human_bytes(abs(w.headroom_bytes)))
        t.add_row(w.mode, " ".join(w.overrides), human_bytes(w.device_bytes), w.peak_phase,
                  human_bytes(w.host_bytes) if w.host_bytes else "[dim]0[/]", _verdict(w.fits), head)
    return t


def fp8_table(rep) -> Table:
    s = rep.fp8
    t = _table("FP8 workspaces (Transformer-Engine _fp8_workspaces)", show_header=False, box=None,
               pad_edge=False)
    t.add_column(style="cyan", no_wrap=True)
    t.add_column()
    est = rep.estimate
    if est is not None:
        per_rank = est.per_rank.get("fp8_workspaces", 0)
        t.add_row("estimated", f"{human_bytes(per_rank)} per rank" if per_rank else "none (engine.fp8 is off)")
    if rep.measured or rep.steps:
        if s.workspaces_cleared:
            t.add_row("cleared", f"{s.workspaces_cleared:,} entries, {human_bytes(s.bytes_freed)} in {s.offloads} "
                                 f"offload phase{'s' if s.offloads != 1 else ''}")
            t.add_row("last offload", f"{s.last_cleared:,} entries, {human_bytes(s.last_bytes_freed)} freed")
        else:
            t.add_row("cleared", f"none in {s.offloads} offload phase{'s' if s.offloads != 1 else ''} (parameter "
                                 "offload clears them; they exist only with engine.fp8 on Transformer-Engine)")
    return t


def fixes_table(est) -> Table:
    t = _table(f"Top fixes (ranked by bytes saved from the {human_bytes(est.peak_bytes)} peak)")
    for name, just in (("#", "right"), ("fix", "left"), ("overrides", "left"), ("saves", "right"),
                       ("new peak", "right"), ("verdict", "left"), ("why", "left")):
        t.add_column(name, justify=just, no_wrap=name in ("#", "saves", "new peak", "verdict"))
    for i, f in enumerate(est.fixes, 1):
        t.add_row(str(i), f.name, " ".join(f.overrides), human_bytes(f.bytes_saved), human_bytes(f.new_peak_bytes),
                  _verdict(f.fits), f.why)
    if not est.fixes:
        t.caption = "no single config change lowers the estimated peak"
    return t
