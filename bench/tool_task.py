"""Does the built-in tool task learn, and does the tool help? `rl train task=tool_add` with the
calculator (rollout.max_turns=2) beside its no-tool twin (rollout.max_turns=1: a call ends the
trajectory unanswered), per seed, with the held-out accuracy at the end (greedy, exact answers).

    OMP_NUM_THREADS=2 python bench/tool_task.py --seeds 0 1 2 --steps 500 [--json out.json]
    # the tool runs sampled ahead of the update (trainer.mode) beside sync, without the twins:
    OMP_NUM_THREADS=1 python bench/tool_task.py --modes sync one_step_off --no-twin --parallel 2

Prints a markdown table (docs/agents.md has the figures). Train figures are the last 20 steps' means.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = ["task=tool_add", "optim.lr=0.002", "data.train_batch_size=16", "algorithm.rollout_n=8",
            "rollout.max_new_tokens=9", "trainer.device=cpu", "checkpoint.save_freq=0", "checkpoint.save_final=false",
            "trainer.sample_log_freq=0"]


def run(seed: int, steps: int, turns: int, root: Path, threads: int, mode: str = "sync") -> dict:
    d = root / f"turns{turns}-{mode}-seed{seed}"
    cmd = [sys.executable, "-m", "rlcli.main", "train", *SETTINGS, f"rollout.max_turns={turns}", f"trainer.mode={mode}",
           f"trainer.total_steps={steps}", f"trainer.val_freq={steps}", f"trainer.seed={seed}",
           f"trainer.threads_per_rank={threads}", f"checkpoint.dir={d}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (d / "validation.jsonl").read_text().splitlines()][-1]
    last = rows[-20:]
    mean = lambda f: sum(f(r) for r in last) / len(last)  # noqa: E731
    return {"seed": seed, "tool": turns > 1, "mode": mode, "steps": len(rows), "train_reward": mean(lambda r: r["reward_mean"]),
            "train_accuracy": mean(lambda r: r["accuracy"]), "turns": mean(lambda r: r["algo"]["agent_turns_mean"]),
            "tool_calls": mean(lambda r: r["algo"]["agent_tool_calls"]),
            "heldout_accuracy": val["accuracy"], "heldout_reward": val["reward"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["sync"], choices=["sync", "one_step_off"],
                    help="trainer.mode of the runs")
    ap.add_argument("--no-twin", action="store_true", help="skip the no-tool twins (rollout.max_turns=1)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory(prefix="tool-task-") as tmp, ThreadPoolExecutor(args.parallel) as pool:
        jobs = [(seed, args.steps, turns, Path(tmp), args.threads, mode)
                for turns in ((2,) if args.no_twin else (2, 1)) for mode in args.modes for seed in args.seeds]
        out = []
        for r in pool.map(lambda j: run(*j), jobs):
            out.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print("| run | mode | seed | train reward (incl. bonus) | train accuracy | turns | tool calls | held-out accuracy | held-out reward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {'with tool' if r['tool'] else 'no tool'} | {r['mode']} | {r['seed']} | {r['train_reward']:.3f} | "
              f"{r['train_accuracy']:.3f} | {r['turns']:.2f} | {r['tool_calls']:.2f} | {r['heldout_accuracy']:.3f} | "
              f"{r['heldout_reward']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
