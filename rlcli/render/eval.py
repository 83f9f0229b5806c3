"""Rich rendering of `rl eval`'s result: what was evaluated and how, then one row per data
source (and one for all of them) with the greedy and sampled numbers and pass@k."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def eval_view(r) -> Group:
    src = r.source
    head = Table(title="rl eval", show_header=False, title_justify="left", title_style="bold")
    head.add_column(style="cyan", no_wrap=True)
    head.add_column()
    kind = {"checkpoint": "rl checkpoint", "export": "rl export", "hf": "Hugging Face directory"}[src["kind"]]
    where = f"{src['step_dir']} (step {src['step']})" if src.get("step_dir") else src["path"]
    head.add_row("model", f"{where}  [dim]({kind})[/]")
    head.add_row("config", f"{src['config_from']} + overrides")
    head.add_row("task", f"{r.task}, {r.split} split: {r.prompts} prompts; reward {r.reward}")
    passes = (["greedy"] if r.greedy else []) + (
        [f"{r.n} samples/prompt at T={r.temperature:g}" + (f", top_p {r.top_p:g}" if r.top_p < 1 else "")]
        if r.n else [])
    head.add_row("passes", f"{' + '.join(passes)}; up to {r.max_new_tokens} new tokens; {r.sampler} sampler on "
                           f"{r.device}")
    head.add_row("correct", r.correct_from)
    t = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
              padding=(0, 1), collapse_padding=True)
    col = dict(justify="right", no_wrap=True)
    t.add_column("data\nsource", overflow="fold")
    t.add_column("prompts", **col)
    if r.greedy:
        t.add_column("greedy\nacc", **col)
        t.add_column("greedy\nreward", **col)
    if r.n:
        t.add_column("sampled\nacc", **col)
        t.add_column("sampled\nreward", **col)
        for k in r.k:
            t.add_column(f"pass@{k}", **col)
    rows = list(r.by_source) + ([r.overall] if len(r.by_source) > 1 else [])
    for s in rows:
        cells = [s.data_source if s is not r.overall else "[bold]all[/]", str(s.prompts)]
        if r.greedy:
            cells += [_pct(s.greedy_accuracy), _num(s.greedy_reward)]
        if r.n:
            cells += [_pct(s.sampled_accuracy), _num(s.sampled_reward)] + [_pct(s.pass_at_k.get(k)) for k in r.k]
        t.add_row(*cells)
    foot = []
    if r.reward_failures:
        foot.append(f"[yellow]{r.reward_failures} reward call(s) failed and scored 0 (task.reward_on_error=zero)[/]")
    foot.append(f"[dim]{r.responses} responses -> {r.output}[/]" if r.output else
                f"[dim]{r.responses} responses scored (eval.output is empty: none written)[/]")
    foot.append(f"[dim]{r.seconds:.1f} s[/]")
    return Group(head, t, *foot)
