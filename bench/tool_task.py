"""Does the built-in tool task learn, and does the tool help? `rl train task=tool_add` with the
calculator (rollout.max_turns=2) beside its no-tool twin (rollout.max_turns=1: a call ends the
trajectory unanswered), per seed, with the held-out accuracy at the end (greedy, exact answers).

    OMP_NUM_THREADS=2 python bench/tool_task.py --seeds 0 1 2 --steps 500 [--json out.json]

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


def run(seed: int, steps: int, turns: int, root: Path, threads: int) -> dict:
    d = root / f"turns{turns}-seed{seed}"
    cmd = [sys.executable, "-m", "rlcli.main", "train", *SETTINGS, f"rollout.max_turns={turns}",
           f"trainer.total_steps={steps}", f"trainer.val_freq={steps}", f"trainer.seed={seed}",
           f"trainer.threads_per_rank={threads}", f"checkpoint.dir={d}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (d / "validation.jsonl").read_text().splitlines()][-1]
    last = rows[-20:]
    mean = lambda f: sum(f(r) for r in last) / len(last)  # noqa: E731
    return {"seed": seed, "tool": turns > 1, "steps": len(rows), "train_reward": mean(lambda r: r["reward_mean"]),
            "train_accuracy": mean(lambda r: r["accuracy"]), "turns": mean(lambda r: r["algo"]["agent_turns_mean"]),
            "tool_calls": mean(lambda r: r["algo"]["agent_tool_calls"]),
            "heldout_accuracy": val["accuracy"], "heldout_reward": val["reward"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory(prefix="tool-task-") as tmp:
        for turns in (2, 1):
            for seed in args.seeds:
                out.append(run(seed, args.steps, turns, Path(tmp), args.threads))
                print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    print("| run | seed | train reward (incl. bonus) | train accuracy | turns | tool calls | held-out accuracy | held-out reward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {'with tool' if r['tool'] else 'no tool'} | {r['seed']} | {r['train_reward']:.3f} | "
              f"{r['train_accuracy']:.3f} | {r['turns']:.2f} | {r['tool_calls']:.2f} | {r['heldout_accuracy']:.3f} | "
              f"{r['heldout_reward']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
