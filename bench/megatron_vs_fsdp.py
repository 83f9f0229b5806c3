"""Wall time and learning of `rl train` on the megatron backend beside the FSDP2 baseline,
same job, measured in the same run (runs interleaved so machine load hits both alike).

    python bench/megatron_vs_fsdp.py                 # default job, 1 and 2 ranks, 1 repeat
    python bench/megatron_vs_fsdp.py --repeats 2 trainer.total_steps=20

Rows: fsdp 1 rank | megatron TP=1 | fsdp 2 ranks (DP=2) | megatron TP=2 (2 ranks) |
megatron TP=1 x DP=2. Ratios are megatron / fsdp at the same rank count (median wall time).
Extra arguments are passed to every `rl train` as overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUNS = [
    ("fsdp", 1, 1),
    ("megatron", 1, 1),
    ("fsdp", 2, 1),
    ("megatron", 2, 2),
    ("megatron", 2, 1),
]


def run(engine: str, nprocs: int, tp: int, overrides: list[str], workdir: str) -> dict:
    out = os.path.join(workdir, f"{engine}_{nprocs}_{tp}_{len(os.listdir(workdir))}")
    cmd = ["rl", "train", "--engine", engine, "--json", f"trainer.nprocs={nprocs}",
           f"checkpoint.dir={out}", "checkpoint.save_freq=0", "checkpoint.save_final=false", *overrides]
    if engine == "megatron":
        cmd.append(f"engine.tensor_model_parallel_size={tp}")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    args, overrides = ap.parse_known_args()
    times: dict[tuple, list[float]] = {r: [] for r in RUNS}
    rewards: dict[tuple, tuple] = {}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeats):
            for r in RUNS:
                j = run(*r, overrides, d)
                times[r].append(j["wall_time_s"])
                rewards[r] = (j["reward_first10"], j["reward_last10"])
    print(f"{'engine':<10}{'ranks':>6}{'tp':>4}{'dp':>4}{'wall s (median)':>17}{'vs fsdp':>9}"
          f"{'reward first10':>16}{'last10':>8}")
    for r in RUNS:
        engine, n, tp = r
        med = statistics.median(times[r])
        base = statistics.median(times[("fsdp", n, 1)])
        print(f"{engine:<10}{n:>6}{tp:>4}{n // tp:>4}{med:>17.1f}{med / base:>8.2f}x"
              f"{rewards[r][0]:>16.3f}{rewards[r][1]:>8.3f}")


if __name__ == "__main__":
    main()
