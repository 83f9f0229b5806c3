"""Benchmark: reward throughput, serial on the driver vs task.reward_workers=N (a spawned
process pool), for a reward function that takes 50 ms per sample, measured in the same run.

Two kinds of 50 ms function, because they scale differently:
  sleep  waits 50 ms (a reward that calls a sandbox, a judge server, a subprocess): workers
         overlap the waiting, so N workers approach N x even on a small machine;
  cpu    spins the CPU for 50 ms (a pure-Python verifier): bounded by the free cores.

Each repetition scores the same batch serially and with the pool (the pool is started once,
before timing, as in a run, where it lives for the whole run); the medians, the speed-up and the
machine's load average are printed.

    OMP_NUM_THREADS=1 python bench/rewards.py [--samples 64] [--workers 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def sleep_50ms(prompt, response, answer, **row):
    time.sleep(0.05)
    return float(response == answer)


def cpu_50ms(prompt, response, answer, **row):
    end = time.process_time() + 0.05
    x = 0
    while time.process_time() < end:
        x += 1
    return float(response == answer)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned workers import `rewards` from here
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from engine.rewards.compute import RewardRunner, samples_of
    from engine.rewards.spec import RewardFnSpec
    from engine.data.example import Example

    examples = [Example(f"q{i}", str(i % 7), {"level": i % 3}, f"bench row {i}") for i in range(args.samples)]
    samples = samples_of(examples, [str(i % 5) for i in range(args.samples)])
    print(f"{args.samples} samples, 50 ms each; {os.cpu_count()} CPUs; load average before: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for kind in ("sleep_50ms", "cpu_50ms"):
        spec = RewardFnSpec(f"rewards:{kind}", f"rewards:{kind}")
        serial = RewardRunner([spec])
        pool = RewardRunner([spec], workers=args.workers, timeout_s=60)
        pool.score(samples[:args.workers])  # start the pool (once per run in training)
        ts, tp = [], []
        try:
            for _ in range(args.reps):
                t = time.perf_counter()
                a = serial.score(samples)
                ts.append(time.perf_counter() - t)
                t = time.perf_counter()
                b = pool.score(samples)
                tp.append(time.perf_counter() - t)
                assert a.total == b.total, "the pool must score exactly as serial"
        finally:
            pool.close()
        s, p = statistics.median(ts), statistics.median(tp)
        print(f"{kind:11s} serial {args.samples / s:7.1f} samples/s ({s:.2f} s)   reward_workers={args.workers} "
              f"{args.samples / p:7.1f} samples/s ({p:.2f} s)   speed-up {s / p:.2f}x")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
