"""Host memory of building an FSDP model on N ranks of one machine: every rank reading the whole
model (before) against rank 0 reading it and the others receiving their shards
(engine/backends/fsdp/rank0_weights.py, what FSDPEngine.build does now).

    OMP_NUM_THREADS=1 python bench/rank0_weights.py --ranks 2 --json out.json

The model is saved once as a Hugging Face directory (safetensors, bf16 as published checkpoints
are; ``--saved-dtype float32``) and read by each mode as the engine reads it (build_hf_model, fp32
masters), sharded per decoder block and at the root. Per
rank: peak resident memory of the process during the build (VmHWM) minus what it held before the build, and the
build's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    """Start this process's peak resident memory (VmHWM) from now. (Not ru_maxrss: Linux keeps a
    parent's peak across fork and exec, so a spawned rank would start at the driver's.)"""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _build(rank, world, mode, path, shape):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from engine.backends.fsdp.rank0_weights import full_state, receive_weights
    from engine.backends.fsdp.units import decoder_blocks
    from engine.config.load import load_run_config
    from engine.model.build import build_hf_model

    cfg = load_run_config([f"model.{k}={v}" for k, v in shape.items()]).config
    import gc

    gc.collect()
    _reset_peak()
    before = _status_mib("VmRSS")
    t0 = time.perf_counter()
    on_meta = mode == "rank0" and rank != 0
    model = build_hf_model(cfg.model, path, 0, 0, load_dtype=torch.float32, on_meta=on_meta)
    whole = full_state(model) if mode == "rank0" and rank == 0 else ({}, {})
    mesh = init_device_mesh("cpu", (world,))
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode == "rank0":
        receive_weights(model, torch.device("cpu"), whole)
    del whole
    gc.collect()
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM")
    local = sum(p.to_local().numel() for p in model.parameters()) * 4 / 2**20
    return {"rank": rank, "peak_over_start_mib": peak - before, "held_after_mib": _status_mib("VmRSS") - before,
            "shard_mib": local, "build_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--saved-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the checkpoint's dtype (published checkpoints are bf16; the engine trains fp32 masters)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.dist_utils import run_ranks

    shape = {"hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4, "num_layers": args.layers,
             "num_attention_heads": 16, "num_key_value_heads": 4}
    report = {"ranks": args.ranks, "shape": shape, "saved_dtype": args.saved_dtype, "modes": {}}
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        hf = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=shape["intermediate_size"],
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                         tie_word_embeddings=False)
        model = LlamaForCausalLM(hf)
        report["params"] = sum(p.numel() for p in model.parameters())
        model.to(getattr(torch, args.saved_dtype)).save_pretrained(d)
        del model
        # each mode in its own processes; every rank is a fresh process whose peak is its own
        for mode in ("every_rank", "rank0"):
            report["modes"][mode] = run_ranks(_build, args.ranks, mode, d, shape)
    full_mib = report["params"] * 4 / 2**20
    print(f"model: {report['params'] / 1e6:.0f}M parameters, {full_mib:.0f} MiB in fp32, saved in {args.saved_dtype}; "
          f"{args.ranks} ranks")
    print(f"{'mode':11s} {'rank':>4s} {'peak over start MiB':>20s} {'held after MiB':>15s} {'shard MiB':>10s} {'build s':>8s}")
    for mode, rows in report["modes"].items():
        for r in rows:
            print(f"{mode:11s} {r['rank']:4d} {r['peak_over_start_mib']:20.0f} {r['held_after_mib']:15.0f} "
                  f"{r['shard_mib']:10.0f} {r['build_s']:8.2f}")
    host = {m: sum(r["peak_over_start_mib"] for r in rows) for m, rows in report["modes"].items()}
    report["host_peak_sum_mib"] = host
    print(f"sum of the ranks' peaks: every_rank {host['every_rank']:.0f} MiB, rank0 {host['rank0']:.0f} MiB "
          f"({host['rank0'] / host['every_rank']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
