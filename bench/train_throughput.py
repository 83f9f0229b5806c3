"""Rollout and update throughput of the FSDP2 engine, before and after the speed work, in the
same run, with the update's achieved FLOP/s as a fraction of a matmul peak measured now.

    OMP_NUM_THREADS=2 python bench/train_throughput.py                  # the issue-17 shape (3.4M)
    OMP_NUM_THREADS=2 python bench/train_throughput.py --hidden 64 --layers 2 --heads 4 --kv-heads 2 \
        --intermediate 128 --vocab 32 --prompts 32 --n 8 --new-tokens 12   # the embedded default's size
    OMP_NUM_THREADS=2 python bench/train_throughput.py --modes fast --ignore-eos --hog 1   # a busy machine

Two engines with the same initial weights run alternately, step by step:
``plain`` -- torch's own GEMM (MKL), the torch sampler's plain loop (every row prefilled, finished rows kept, sampling on
the host), the plain update forward (prompts recomputed for every sample) and FSDP2 with a unit per decoder layer
(``engine.fsdp_unit=layer``; the defaults train the plain model on one CPU rank);
``dynamic`` -- fast, but every decode step through the model's own forward and growing cache;
``fast`` -- the defaults (one prefill per prompt group, finished rows dropped, on-device sampling,
decode steps on a preallocated KV cache (engine/rollout/static_decode.py), decode lanes (one
thread each, ``rollout.decode_lanes`` auto), each distinct prompt computed once in the update);
``onelane`` -- fast, but one decode lane on all threads (``rollout.decode_lanes=1``, before lanes).
``aten`` -- fast, but every linear layer by torch's own GEMM (``engine.cpu_matmul=aten``: MKL on
x86); ``onednn`` -- fast, but every linear layer through oneDNN (``engine.cpu_matmul=onednn``,
engine/model/onednn_linear.py; ``fast`` takes it on AMD CPUs, MKL on Intel ones);
``fused`` -- fast, plus the update's fused RMSNorm/SiLU-gate kernels (``engine.fused_kernels``;
compiled in the warm-up step, which is not timed).
Update FLOP/s count 6 x matmul params x real tokens (prompt + response): the work of the plain
forward+backward on the real tokens, so ``fast`` gets credit for computing less.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

from engine.threads import apply_process_defaults, omp_spin_count, user_chose_omp_waits

apply_process_defaults()  # before torch: passive OpenMP waits (engine/threads.py)

if not user_chose_omp_waits():  # the waits a rank gets (trainer.omp_wait=auto), set before torch loads OpenMP
    os.environ["GOMP_SPINCOUNT"] = str(omp_spin_count("auto", int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))))
import torch  # noqa: E402


def matmul_peak_flops(n: int = 1024, seconds: float = 1.0) -> float:
    """The best fp32 n^3 matmul rate of torch's own GEMM (``a @ b``: MKL on x86) and oneDNN's
    (engine.cpu_matmul): MFU is against the machine's peak, not against the slower library's."""
    from engine.model.onednn_linear import onednn_available, onednn_matmul

    a, b = torch.randn(n, n), torch.randn(n, n)
    fns = [lambda: a @ b]
    if onednn_available():
        bt = b.t().contiguous()
        fns.append(lambda: onednn_matmul(a, bt, None))
    best = 0.0
    for fn in fns:
        fn()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            reps += 1
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[8, 20], help="prompt lengths drawn from [lo, hi]")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true", help="fixed-length responses (rollout.ignore_eos)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["plain", "fast"],
                    choices=["plain", "dynamic", "onelane", "aten", "onednn", "fast", "fused"],
                    help="aten = fast with engine.cpu_matmul=aten (MKL); dynamic = fast but decoding through the model's own forward (no static KV cache); "
                         "onelane = fast with one decode lane; fused = fast with engine.fused_kernels (its "
                         "compile is paid in the warm-up step)")
    ap.add_argument("--hog", type=int, default=0,
                    help="busy-loop processes running during the measured steps (a busy machine)")
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)

    import torch.distributed as dist

    from engine.algorithms.advantages import grpo_advantages, token_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.rollout.torch_sampler import TorchSampler

    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cfg = load_run_config([f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                           f"model.num_attention_heads={args.heads}", f"model.num_key_value_heads={args.kv_heads}",
                           f"model.intermediate_size={args.intermediate}", "model.max_position_embeddings=1024",
                           f"rollout.max_new_tokens={args.new_tokens}", f"rollout.ignore_eos={args.ignore_eos}",
                           "optim.lr=1e-5"]).config
    PAD, EOS = 0, 1
    runs = {}
    for mode in args.modes:
        engine_cfg = dataclasses.replace(cfg.engine, fused_kernels=mode == "fused",
                                         cpu_matmul="aten" if mode in ("plain", "aten") else
                                         "onednn" if mode == "onednn" else cfg.engine.cpu_matmul,
                                         fsdp_unit="layer" if mode == "plain" else cfg.engine.fsdp_unit)
        mode_cfg = dataclasses.replace(cfg, engine=engine_cfg)
        eng = FSDPEngine(mode_cfg, "", args.vocab, PAD, EOS, torch.device("cpu"), 1)
        eng.build()
        eng.share_prompts = mode != "plain"
        rollout_cfg = dataclasses.replace(cfg.rollout, decode_lanes=1) if mode == "onelane" else cfg.rollout
        runs[mode] = {"eng": eng, "sampler": TorchSampler(rollout_cfg, PAD, EOS, eng.device, fast=mode != "plain",
                                                          static_cache=mode in ("fast", "onelane", "aten", "onednn", "fused")),
                      "gen": torch.Generator().manual_seed(0), "roll": [], "upd": [], "roll_tok": [], "upd_tok": []}
    g = torch.Generator().manual_seed(0)
    lo, hi = args.prompt_len
    prompts = [torch.randint(2, args.vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(args.prompts)]
    eng0 = next(iter(runs.values()))["eng"]
    n_params = eng0.param_count()
    matmul_params = n_params - args.hidden * args.vocab  # the input embedding is a lookup

    def _steps(args, runs, prompts) -> None:
        for step in range(args.steps + 1):
            for mode, r in runs.items():
                eng, sampler = r["eng"], r["sampler"]
                t0 = time.perf_counter()
                with eng.generation_model() as m:
                    batch = sampler.generate(m, prompts, args.n, r["gen"])
                t1 = time.perf_counter()
                rewards = torch.rand(len(batch), generator=r["gen"])
                batch.advantages = token_advantages(grpo_advantages(rewards, args.n), batch.response_mask)
                t2 = time.perf_counter()
                stats = eng.train_step(batch, PolicyLoss(cfg.algorithm, 1))
                t3 = time.perf_counter()
                if step == 0:
                    continue  # warm-up
                r["roll"].append(t1 - t0)
                r["roll_tok"].append(float(batch.response_mask.sum()))
                r["upd"].append(t3 - t2)
                r["upd_tok"].append(stats.tokens)

    peaks = [matmul_peak_flops()]
    loads = [os.getloadavg()[0]]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    try:
        _steps(args, runs, prompts)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    peaks.append(matmul_peak_flops())
    loads.append(os.getloadavg()[0])
    peak = statistics.median(peaks)
    print(f"model: {n_params:,} params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
          f"threads {threads}, load {min(loads):.1f}-{max(loads):.1f}, OpenMP waits "
          f"{os.environ.get('OMP_WAIT_POLICY', '-')}, spin count {os.environ.get('GOMP_SPINCOUNT', '-')} (as a rank's trainer.omp_wait=auto), "
          f"{args.hog} busy processes during the steps")
    print(f"batch: {args.prompts} prompts x {args.n} samples, prompts {lo}-{hi} tokens, up to {args.new_tokens} new "
          f"tokens{' (fixed length)' if args.ignore_eos else ''}, {args.steps} steps after 1 warm-up, medians")
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (fp32 1024^3, the best of MKL and oneDNN, measured before and after)")
    print(f"{'mode':7s} {'rollout s':>9s} {'rollout tok/s':>13s} {'update s':>9s} {'update tok/s':>12s} "
          f"{'update GFLOP/s':>14s} {'update MFU':>10s}")
    res = {}
    for mode, r in runs.items():
        roll = statistics.median(r["roll"])
        upd = statistics.median(r["upd"])
        roll_tps = statistics.median(t / s for t, s in zip(r["roll_tok"], r["roll"]))
        upd_tps = statistics.median(t / s for t, s in zip(r["upd_tok"], r["upd"]))
        flops = 6 * matmul_params * upd_tps
        res[mode] = (roll_tps, upd_tps)
        print(f"{mode:7s} {roll:9.3f} {roll_tps:13,.0f} {upd:9.3f} {upd_tps:12,.0f} {flops / 1e9:14.2f} "
              f"{100 * flops / peak:9.1f}%")
    for base, new in (("plain", "fast"), ("dynamic", "fast"), ("onelane", "fast"), ("aten", "fast"), ("aten", "onednn"), ("fast", "fused")):
        if base in res and new in res:
            (pr, pu), (fr, fu) = res[base], res[new]
            print(f"{new} / {base}: rollout {fr / pr:.2f}x, update {fu / pu:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
