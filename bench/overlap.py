"""Wall time per step with rollouts sampled ahead of the update (trainer.mode), beside sync, in one run.

    OMP_NUM_THREADS=2 python bench/overlap.py                       # default job + the hidden-256 shape
    OMP_NUM_THREADS=2 python bench/overlap.py --jobs default --steps 30 --modes sync one_step_off
    python bench/overlap.py --jobs shape256 --rl-extra rollout=vllm  # vLLM samples in its own process
    # a slow reward scored chunk by chunk while the ranks sample (trainer.stream_groups), against sync
    # with the same chunks:
    python bench/overlap.py --jobs shape256 --modes sync sync_stream --reward-sleep-ms 4 --rl-extra rollout.micro_batch_size=16
    # multi-turn: task=tool_add whose calculator answers after a sandbox's latency, in the reward pool
    python bench/overlap.py --jobs tools --modes sync one_step_off --tool-latency-ms 100

Each (job, mode) is one real `rl train`; the figures are medians over its steps after the first two
(start-up and the first rollout, which nothing can overlap, left out): the step's wall time, the
rollout's own sampling time, the time the step waited for a queued rollout (`rollout_wait`), the
time it waited for rewards (`reward`) and the scoring done while it did something else
(`reward_ahead`), the update and what of it came after the rollout's end (`upd-tail`: all of it
but in trainer.mode=streamed, whose update starts on the first complete groups), the weight export
to the rollout worker, and the ratio of the step time to sync's measured
in the same invocation. `default` is `rl train`'s embedded job; `shape256` is bench/learning.py's
`reverse` job (a 3.4M-parameter Llama, hidden 256, 8 prompts x 8 samples, 32 new tokens: the
shape bench/vs_trl.py calls `base`); `tools` is the built-in multi-turn `tool_add` task (8 prompts x 8
trajectories, up to 3 model turns of 8 tokens) with its calculator behind ``--tool-latency-ms`` a call,
the calls of a turn run 8 at a time in the reward process pool (task.reward_workers=8)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": ["trainer.mode=sync"], "one_step_off": ["trainer.mode=one_step_off"],
         "async2": ["trainer.mode=async", "trainer.max_staleness=2"],
         "sync_stream": ["trainer.mode=sync", "trainer.stream_groups=true"],
         "streamed": ["trainer.mode=streamed"]}
SLOW_REWARD = """import time
from learning_reward import rl_reward as _reward

def slow_reward(prompt, response, answer):
    time.sleep({ms} / 1000)  # a sandbox or a verifier's cost, per sample
    return _reward(prompt, response, answer)
"""
SLOW_TOOLS = """import time

from engine.agents.calculator_env import CalculatorEnvironment
from engine.tasks.tool_add import calculator as _calculator


def calculator(expr: str) -> str:
    time.sleep({ms} / 1000)  # a sandbox's round trip
    return _calculator(expr)


class SlowCalculator(CalculatorEnvironment):
    def __init__(self):
        super().__init__()
        self.tools = {{"calculator": calculator}}
"""


def job_overrides(job: str, work: Path, steps: int, tool_ms: float = 0.0) -> tuple[list[str], Path]:
    if job == "default":
        return [f"trainer.total_steps={steps}"], work
    if job == "tools":
        (work / "slow_tools.py").write_text(SLOW_TOOLS.format(ms=tool_ms))
        return [f"trainer.total_steps={steps}", "task=tool_add", "task.environment=slow_tools:SlowCalculator",
                "task.reward_workers=8", "rollout.max_turns=3", "rollout.max_new_tokens=8", "data.train_batch_size=8",
                "algorithm.rollout_n=8"], work
    sys.path.insert(0, str(ROOT))
    from bench.learning import build_job, rl_overrides

    job_dir = build_job(work, "reverse")
    return rl_overrides(job_dir, work / "model", 0, steps), job_dir


def slow_reward_overrides(job: str, cwd: Path, ms: float) -> list[str]:
    """--reward-sleep-ms: the job's reward behind a per-sample sleep (shape256 only)."""
    if ms <= 0:
        return []
    if job != "shape256":
        raise SystemExit("--reward-sleep-ms wraps the shape256 job's reward function; use --jobs shape256")
    (cwd / "slow_reward.py").write_text(SLOW_REWARD.format(ms=ms))
    return ["task.reward_fn=slow_reward:slow_reward"]


def run(job: str, mode: str, args, work: Path) -> dict:
    overrides, cwd = job_overrides(job, work, args.steps, args.tool_latency_ms)
    run_dir = Path(tempfile.mkdtemp(prefix="rl-overlap-", dir="/tmp"))
    shutil.rmtree(run_dir)
    overrides += slow_reward_overrides(job, cwd, args.reward_sleep_ms)
    cmd = [sys.executable, "-m", "rlcli.main", "train", *overrides, *MODES[mode], "checkpoint.save_final=false",
           "checkpoint.save_freq=0", f"checkpoint.dir={run_dir}", *args.rl_extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        if proc.returncode != 0:
            raise SystemExit(f"{job} {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    steady = rows[2:] or rows
    med = lambda f: statistics.median(f(r) for r in steady)  # noqa: E731
    return {"job": job, "mode": mode, "wall_s": wall, "step_s": med(lambda r: r["step_time_s"]),
            "rollout_s": med(lambda r: r["timing"].get("rollout", 0.0)),
            "wait_s": med(lambda r: r["timing"].get("rollout_wait", r["timing"].get("rollout", 0.0))),
            "reward_s": med(lambda r: r["timing"].get("reward", 0.0)),
            "reward_ahead_s": med(lambda r: r["timing"].get("reward_ahead", 0.0)),
            "update_s": med(lambda r: r["timing"].get("update", 0.0)),
            # what the step still waited for the update once the rollout had ended (streamed: its tail)
            "tail_s": med(lambda r: r["timing"].get("update_after_rollout", r["timing"].get("update", 0.0))),
            "sync_s": med(lambda r: r["timing"].get("weight_sync", 0.0)),
            "reward_last5": statistics.mean(r["reward_mean"] for r in rows[-5:]),
            "staleness_max": max((r.get("staleness") or {}).get("max", 0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", nargs="+", default=["default", "shape256"], choices=["default", "shape256", "tools"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rl-extra", nargs="*", default=[])
    ap.add_argument("--reward-sleep-ms", type=float, default=0.0, help="shape256: the reward sleeps this long a sample")
    ap.add_argument("--tool-latency-ms", type=float, default=100.0, help="tools: each calculator call sleeps this long")
    ap.add_argument("--work", default="/tmp/rl-overlap")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for job in args.jobs:
        for mode in args.modes:
            results.append(run(job, mode, args, work))
            r = results[-1]
            print(f"  {job:8s} {mode:13s} step {r['step_s']:.3f} s (rollout {r['rollout_s']:.3f}, waited "
                  f"{r['wait_s']:.3f}, reward waited {r['reward_s']:.3f} of {r['reward_ahead_s'] or r['reward_s']:.3f}, update {r['update_s']:.3f}, sync {r['sync_s']:.3f}), wall {r['wall_s']:.0f} s",
                  flush=True)
    print(f"\n{args.steps} steps; medians of steps 3..{args.steps}; extra: {' '.join(args.rl_extra) or '-'}")
    print(f"{'job':9s} {'mode':13s} {'s/step':>7s} {'vs sync':>8s} {'rollout':>8s} {'waited':>7s} {'update':>7s} "
          f"{'upd-tail':>8s} {'w-sync':>7s} {'stale':>6s} {'reward':>7s}")
    for r in results:
        base = next((x for x in results if x["job"] == r["job"] and x["mode"] == "sync"), None)
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        print(f"{r['job']:9s} {r['mode']:13s} {r['step_s']:7.3f} {ratio:>8s} {r['rollout_s']:8.3f} {r['wait_s']:7.3f} "
              f"{r['update_s']:7.3f} {r['tail_s']:8.3f} {r['sync_s']:7.3f} {r['staleness_max']:6d} {r['reward_last5']:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
