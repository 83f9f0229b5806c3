"""A rank's step with and without keeping freed host memory (trainer.keep_host_heap,
engine/host_heap.py), whole processes alternated, at the issue-17 shape.

    OMP_NUM_THREADS=2 python bench/host_heap.py
    OMP_NUM_THREADS=2 python bench/host_heap.py --pairs 4 --hidden 512 --layers 8 --intermediate 1376  # bigger

malloc's thresholds are per process, so each side is its own process (one FSDP2 engine, the
default fast rollout and prompt-shared update, 3.4M parameters, 8 prompts x 8 samples x 32
tokens); the pairs alternate which side goes first. Each process prints the medians of its
steps after a warm-up: rollout and update seconds, the update's minor page faults, and the
step's CPU time (user + system, less sensitive to other load than wall time). The summary is
the median over processes and the ratios default / tuned.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_process(args) -> dict:
    import resource
    import tempfile

    from engine.threads import apply_process_defaults

    apply_process_defaults()  # before torch: passive OpenMP waits (engine/threads.py)
    from engine.host_heap import keep_host_heap

    note = keep_host_heap() if args.tuned else "glibc defaults"
    import torch
    import torch.distributed as dist

    from engine.algorithms.advantages import grpo_advantages, token_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.rollout.torch_sampler import TorchSampler

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    cfg = load_run_config([f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                           f"model.num_attention_heads={args.heads}", f"model.num_key_value_heads={args.heads}",
                           f"model.intermediate_size={args.intermediate}", "model.max_position_embeddings=1024",
                           f"rollout.max_new_tokens={args.new_tokens}", "rollout.ignore_eos=true",
                           "optim.lr=1e-5"]).config
    eng = FSDPEngine(cfg, "", args.vocab, 0, 1, torch.device("cpu"), 1)
    eng.build()
    sampler = TorchSampler(cfg.rollout, 0, 1, eng.device, fast=True, static_cache=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, args.vocab, (int(torch.randint(8, 21, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    rows = {"rollout_s": [], "update_s": [], "update_faults": [], "step_cpu_s": []}
    for step in range(args.steps + 1):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        with eng.generation_model() as m:
            batch = sampler.generate(m, prompts, args.n, g)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        batch.advantages = token_advantages(grpo_advantages(torch.rand(len(batch), generator=g), args.n),
                                            batch.response_mask)
        t2 = time.perf_counter()
        eng.train_step(batch, PolicyLoss(cfg.algorithm, 1))
        r3, t3 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if step:  # the first step is a warm-up
            rows["rollout_s"].append(t1 - t0)
            rows["update_s"].append(t3 - t2)
            rows["update_faults"].append(r3.ru_minflt - r1.ru_minflt)
            rows["step_cpu_s"].append(r3.ru_utime + r3.ru_stime - r0.ru_utime - r0.ru_stime)
    dist.destroy_process_group()
    return {"note": note or "tuned", **{k: statistics.median(v) for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3, help="tuned/default process pairs, alternating the order")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--child", choices=["tuned", "default"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.tuned = args.child == "tuned"
        print(json.dumps(one_process(args)))
        return
    child_args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("pairs", "child")]
    results: dict[str, list[dict]] = {"default": [], "tuned": []}
    loads = [os.getloadavg()[0]]
    for i in range(args.pairs):
        for side in (("tuned", "default") if i % 2 else ("default", "tuned")):
            out = subprocess.run([sys.executable, __file__, *child_args, "--child", side], capture_output=True,
                                 text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results[side].append(r)
            print(f"{side:7s} rollout {r['rollout_s']:.3f} s  update {r['update_s']:.3f} s  update faults "
                  f"{r['update_faults']:,.0f}  step CPU {r['step_cpu_s']:.3f} s  ({r['note']})", flush=True)
        loads.append(os.getloadavg()[0])
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("rollout_s", "update_s", "update_faults",
                                                                 "step_cpu_s")} for s, rs in results.items()}
    print(f"\nmedians over {args.pairs} processes each, load {min(loads):.1f}-{max(loads):.1f}:")
    for s, m in med.items():
        print(f"{s:7s} rollout {m['rollout_s']:.3f} s  update {m['update_s']:.3f} s  update faults "
              f"{m['update_faults']:,.0f}  step CPU {m['step_cpu_s']:.3f} s")
    d, t = med["default"], med["tuned"]
    print(f"default / tuned: rollout {d['rollout_s'] / t['rollout_s']:.2f}x, update {d['update_s'] / t['update_s']:.2f}x, "
          f"step CPU {d['step_cpu_s'] / t['step_cpu_s']:.2f}x")


if __name__ == "__main__":
    main()
