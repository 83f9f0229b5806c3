"""Rollout and update throughput of the FSDP2 engine, and the update's achieved FLOP/s as a
fraction of a matmul peak measured in the same run.

    python bench/train_throughput.py                       # the default tiny model
    python bench/train_throughput.py --hidden 256 --layers 4 --heads 8 --kv-heads 4
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def matmul_peak_flops(n: int = 1024, seconds: float = 2.0) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)

    import torch.distributed as dist

    from engine.algorithms.advantages import grpo_advantages, token_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.model.tokenizer import CharTokenizer
    from engine.rollout.torch_sampler import TorchSampler
    from engine.tasks.registry import make_task

    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cfg = load_run_config([f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                           f"model.num_attention_heads={args.heads}", f"model.num_key_value_heads={args.kv_heads}",
                           f"model.intermediate_size={args.hidden * 2}", f"rollout.max_new_tokens={args.new_tokens}"]).config
    task = make_task(cfg.task, 0)
    tok = CharTokenizer(task.alphabet)
    eng = FSDPEngine(cfg, "", tok.vocab_size, tok.pad_token_id, tok.eos_token_id, torch.device("cpu"), 1)
    eng.build()
    sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, eng.device)
    prompts = [tok.encode(e.prompt) for e in task.train[:args.prompts]]
    g = torch.Generator().manual_seed(0)
    n_params = eng.param_count()
    embed = cfg.model.hidden_size * tok.vocab_size  # the input embedding is a lookup, not a matmul
    peak = matmul_peak_flops()

    roll_tok = roll_t = upd_tok = upd_t = 0.0
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        with eng.generation_model() as m:
            batch = sampler.generate(m, prompts, args.n, g)
        t1 = time.perf_counter()
        rewards = torch.rand(len(batch), generator=g)
        batch.advantages = token_advantages(grpo_advantages(rewards, args.n), batch.response_mask)
        t2 = time.perf_counter()
        stats = eng.train_step(batch, PolicyLoss(cfg.algorithm, 1))
        t3 = time.perf_counter()
        if step == 0:
            continue  # warm-up
        roll_tok += float(batch.response_mask.sum())
        roll_t += t1 - t0
        upd_tok += stats.padded_tokens
        upd_t += t3 - t2
    flops = 6 * (n_params - embed) * upd_tok / upd_t  # fwd + bwd matmuls on every processed token
    print(f"model: {n_params:,} params (hidden {args.hidden}, {args.layers} layers), threads {threads}")
    print(f"batch: {args.prompts} prompts x {args.n} samples, up to {args.new_tokens} new tokens, {args.steps} steps")
    print(f"rollout  tokens/s : {roll_tok / roll_t:12,.0f}   (response tokens generated, KV cache)")
    print(f"update   tokens/s : {upd_tok / upd_t:12,.0f}   (tokens through forward+backward)")
    print(f"matmul peak       : {peak / 1e9:12,.2f} GFLOP/s  (fp32 1024^3, measured now)")
    print(f"update achieved   : {flops / 1e9:12,.3f} GFLOP/s  = {100 * flops / peak:.2f}% of the matmul peak")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
