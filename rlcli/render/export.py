"""Rich rendering of `rl export`'s result: where from, where to, and every file written."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


KIND = {"model": "full model", "merged-lora": "LoRA merged into the base weights",
        "lora-adapter": "PEFT LoRA adapter (base model not included)"}


def export_table(r) -> Group:
    t = Table(title="rl export", show_header=False, title_justify="left", title_style="bold")
    t.add_column(style="cyan", no_wrap=True)
    t.add_column()
    par = r.parallel or {}
    layout = f"{r.engine}, {r.world_size} rank{'s' if r.world_size != 1 else ''}"
    if par.get("tp", 1) > 1:
        layout += f" (TP {par['tp']} x DP {par.get('dp', 1)})"
    t.add_row("source", f"{r.source_step_dir}  (step {r.step}; {layout})")
    t.add_row("written", f"[bold]{r.out_dir}[/]")
    t.add_row("kind", KIND.get(r.kind, r.kind))
    t.add_row("model", f"{r.model_type}, {r.num_params:,} parameters in {r.num_tensors} tensors")
    t.add_row("dtype", r.dtype)
    t.add_row("config/tokenizer from", r.base_model)
    t.add_row("time / peak RSS", f"{r.seconds:.1f} s / {_size(r.peak_rss_bytes)}")
    files = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    files.add_column("file")
    files.add_column("size", justify="right")
    for f in r.files:
        files.add_row(f.name, _size(f.bytes))
    files.add_row("[bold]total[/]", f"[bold]{_size(r.total_bytes)}[/]")
    load = (f"load: AutoModelForCausalLM.from_pretrained({r.out_dir!r})" if r.kind != "lora-adapter" else
            f"load: PeftModel.from_pretrained(base, {r.out_dir!r})")
    return Group(t, files, f"[dim]{load}[/]")
