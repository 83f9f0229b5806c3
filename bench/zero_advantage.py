"""The update with and without skipping zero-advantage rows (engine.skip_zero_advantage_rows),
in the same run, at the issue-17 shape, for several shares of idle prompt groups (groups whose
samples all scored the same: what 0/1 rewards give when a prompt is always or never solved).

    OMP_NUM_THREADS=2 python bench/zero_advantage.py
    OMP_NUM_THREADS=2 python bench/zero_advantage.py --idle 0 0.5 --steps 8

Two FSDP2 engines with the same initial weights (one skipping, one not) train alternately on
the same rolled-out batch; each step's rewards make the requested share of groups idle (all
samples 0 or all 1) and draw 0/1 rewards for the others. Prints median update seconds and the
ratio (not skipping / skipping), which the figures in docs/benchmarks.md come from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

from engine.threads import apply_process_defaults

apply_process_defaults()  # before torch: passive OpenMP waits (engine/threads.py)
import torch


def rewards_with_idle_groups(groups: int, n: int, idle: float, gen: torch.Generator) -> torch.Tensor:
    """0/1 rewards, prompt-major; the first round(idle * groups) groups all 0 or all 1, every
    other group with at least one 0 and one 1."""
    out = torch.zeros(groups, n)
    k = round(idle * groups)
    for g in range(groups):
        if g < k:
            out[g] = float(torch.rand(1, generator=gen) < 0.5)
        else:
            row = (torch.rand(n, generator=gen) < 0.5).float()
            row[0], row[1] = 0.0, 1.0
            out[g] = row[torch.randperm(n, generator=gen)]
    return out.flatten()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--idle", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)

    import torch.distributed as dist

    from engine.algorithms.advantages import grpo_advantages, token_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.rollout.torch_sampler import TorchSampler

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    cfg = load_run_config(["model.hidden_size=256", "model.num_layers=4", "model.num_attention_heads=4",
                           "model.num_key_value_heads=4", "model.intermediate_size=688",
                           "model.max_position_embeddings=1024", f"rollout.max_new_tokens={args.new_tokens}",
                           "rollout.ignore_eos=true", "optim.lr=1e-6"]).config
    vocab, pad, eos = 512, 0, 1
    engines = {}
    for skip in (False, True):
        c = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, skip_zero_advantage_rows=skip))
        eng = FSDPEngine(c, "", vocab, pad, eos, torch.device("cpu"), 1)
        eng.build()
        engines[skip] = eng
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (int(torch.randint(8, 21, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    sampler = TorchSampler(cfg.rollout, pad, eos, engines[False].device)
    with engines[False].generation_model() as m:
        batch = sampler.generate(m, prompts, args.n, g)
    loss = PolicyLoss(cfg.algorithm, 1)
    print(f"model 3.4M (hidden 256, 4 layers, vocab 512), {args.prompts} prompts x {args.n} samples x "
          f"{args.new_tokens} tokens, threads {threads}, load {os.getloadavg()[0]:.1f}, "
          f"{args.steps} steps after 1 warm-up, medians")
    print(f"{'idle groups':>11s} {'update s (all rows)':>19s} {'update s (skipping)':>19s} {'speed-up':>8s}")
    for idle in args.idle:
        times: dict[bool, list[float]] = {False: [], True: []}
        for step in range(args.steps + 1):
            rewards = rewards_with_idle_groups(args.prompts, args.n, idle, g)
            batch.advantages = token_advantages(grpo_advantages(rewards, args.n), batch.response_mask)
            for skip in ((False, True) if step % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                engines[skip].train_step(batch, loss)
                if step:
                    times[skip].append(time.perf_counter() - t0)
        a, b = statistics.median(times[False]), statistics.median(times[True])
        print(f"{idle:11.2f} {a:19.3f} {b:19.3f} {a / b:7.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
