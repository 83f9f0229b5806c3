"""`export_checkpoint`: locate -> refuse early -> rebuild config/tokenizer -> weights into a
temporary directory -> rename into place. Nothing is written until every refusal has passed,
and a failure part-way leaves no output directory."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

from engine.checkpoint.layout import EXPORT_DIRS
from engine.errors import UserError
from engine.export.base_model import load_base_model
from engine.export.locate import EXPORT_MARKER, locate
from engine.export.result import ExportedFile, ExportResult
from engine.export.staging import check_target, staged_dir
from engine.export.weights import DEFAULT_MAX_SHARD_SIZE, checkpoint_model_entries, plan_tensors, write_safetensors

DTYPES = ("float32", "bfloat16", "float16")


def _dtype(name: str | None, cfg_dtype: str) -> str:
    name = name or cfg_dtype or "float32"
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}.", title="invalid option")
    return name


def _check_shard_size(size) -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        n = parse_size_to_int(size) if isinstance(size, str) else int(size)
    except (ValueError, TypeError, OverflowError):
        n = None
    if n is None or n <= 0:  # huggingface_hub takes a negative size and writes one tensor per shard
        raise UserError(f"--max-shard-size {size!r} is not a size above zero; write it like 5GB, 500MB or 100KB (decimal units: TB, GB, MB, KB).",
                        title="invalid option")


def export_checkpoint(path, out=None, dtype: str | None = None, overwrite: bool = False, adapter: bool = False,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> ExportResult:
    """Export ``path`` (a run directory -> its latest complete step, or a step_N directory) to a
    Hugging Face directory ``out`` (default: <step_N>/hf, or <step_N>/hf-adapter with ``adapter``).
    ``dtype`` defaults to the run's model.dtype. LoRA checkpoints are merged into the base
    weights unless ``adapter`` asks for a PEFT adapter directory."""
    t0 = time.perf_counter()
    src = locate(Path(path))
    lora = (src.manifest.get("model") or {}).get("lora")
    if adapter and not lora:
        raise UserError(f"--adapter writes a PEFT adapter directory, but {src.step_dir} is not a LoRA checkpoint "
                        f"(the run had no model.lora.rank). Drop --adapter to export the full model.",
                        title="not a LoRA checkpoint")
    _check_shard_size(max_shard_size)
    out = Path(out) if out else src.step_dir / EXPORT_DIRS[1 if adapter else 0]  # verification skips these
    check_target(out, overwrite, src.step_dir)
    dtype_name = _dtype(dtype, ((src.config.get("model") or {}).get("dtype")))
    torch_dtype = getattr(torch, dtype_name)
    base = load_base_model(src.manifest)
    entries = checkpoint_model_entries(src.state_dir)

    with staged_dir(out) as tmp:
        if lora:
            from engine.export.lora import write_lora

            kind, num_tensors, sharded, params, weight_files = write_lora(src, base, entries, torch_dtype, tmp,
                                                                           adapter, max_shard_size)
        else:
            plan = plan_tensors(base.config, entries, src.step_dir)
            weight_files, sharded, params = write_safetensors(src.state_dir, plan, torch_dtype, tmp, max_shard_size)
            kind, num_tensors = "model", len(plan.names)
        if kind != "lora-adapter":
            base.config.dtype = torch_dtype
            base.config.save_pretrained(tmp)
            base.generation_config.save_pretrained(tmp)
        base.tokenizer.save_pretrained(str(tmp))
        m = src.manifest
        marker = {"format": "rl-export", "version": 1, "kind": kind, "source": str(src.step_dir), "step": src.step,
                  "engine": m.get("engine"), "world_size": m.get("world_size"), "parallel": m.get("parallel"),
                  "dtype": dtype_name, "base_model": base.source, "num_params": params,
                  "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        files = [ExportedFile(p.name, p.stat().st_size) for p in sorted(tmp.iterdir()) if p.is_file()]
    return ExportResult(
        out_dir=str(out), source_step_dir=str(src.step_dir), step=src.step, engine=m.get("engine", "?"),
        world_size=int(m.get("world_size") or 1), parallel=m.get("parallel") or {}, kind=kind, dtype=dtype_name,
        model_type=base.config.model_type, num_params=params, num_tensors=num_tensors, sharded=sharded,
        files=files, base_model=base.source, seconds=time.perf_counter() - t0,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
