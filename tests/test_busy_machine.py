"""An RL step on a busy machine slows no more than the load explains.

The one timing assertion the suite makes (issue 17 asks for it): a rank worker (the real
engine/trainer/worker.RankWorker, in a fresh process with the environment WorkerGroup gives
it) runs RL steps in alternating blocks, quiet and under a CPU hog (one busy-loop process per
two cores -- with the step's own threads, load ~3 on 2 cores, the issue's busy machine -- spawned
here, self-terminating and killed in teardown). A hog of one process per core leaves the step
half the CPU and takes its second core away: 2.7-3.6x on a quiet 2-core machine, at that limit. The median hogged step must stay
within 3x of the median quiet step; with spin-waiting OpenMP threads it was ~45x. The rank runs
as a user on a shared machine is told to run it: `trainer.adapt_threads=true` (threads follow the
free cores; off by default because it makes float sums depend on the load, tests/test_threads.py).
Passive waits alone measured 0.99x and 3.28x here (load ~4 from other work).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.threads import omp_spin_count, rank_env

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = 4          # quiet, hog, quiet, hog
STEPS_PER_BLOCK = 4

WORKER = r"""
import json, statistics, sys, time
import torch
from engine.algorithms.advantages import grpo_advantages, token_advantages
from engine.config.load import load_run_config
from engine.trainer.worker import RankWorker
from engine.config.resolved import resolve_run

threads, blocks, per_block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = load_run_config(["model.hidden_size=128", "model.intermediate_size=256", "model.num_layers=2",
                       "rollout.max_new_tokens=16", "rollout.ignore_eos=true", "data.train_batch_size=8",
                       "algorithm.rollout_n=4", "trainer.device=cpu", "trainer.adapt_threads=true"]).config
V = 64
w = RankWorker(resolve_run(cfg), 0, 1, threads)
w.setup(*w.open_rendezvous(), "", {"size": V, "pad": 0, "eos": 1})
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(2, V, (12,), generator=g).tolist() for _ in range(8)]

def step(i):
    t0 = time.perf_counter()
    w.onload(i)
    batch, _ = w.generate(prompts, 4)
    batch.advantages = token_advantages(grpo_advantages(torch.rand(len(batch), generator=g), 4), batch.response_mask)
    w.train_step(batch)
    w.offload()
    return time.perf_counter() - t0

for i in range(2):
    step(i)  # warm-up
times = []
for b in range(blocks):
    print(f"BLOCK {b}", flush=True)
    sys.stdin.readline()  # the test starts or stops the hog, then says go
    times.append([step(b * per_block + i) for i in range(per_block)])
    print(f"DONE {b}", flush=True)
print("RESULT " + json.dumps({"times": times, "threads": torch.get_num_threads()}), flush=True)
w.shutdown()
"""

HOG = "import time\nt = time.time()\nwhile time.time() - t < 240: pass\n"


@pytest.mark.slow
@pytest.mark.alone
def test_step_under_cpu_hog_within_3x_of_quiet(tmp_path):
    cores = os.cpu_count() or 1
    # what WorkerGroup gives a 1-rank run: trainer.omp_wait=auto spins briefly when the cores are
    # free at launch (they are, before the hog), and the hog arrives later
    env = {**os.environ, "PYTHONPATH": str(ROOT), **rank_env(cores, omp_spin_count("auto", cores))}
    err = open(tmp_path / "worker.err", "w+")
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(cores), str(BLOCKS), str(STEPS_PER_BLOCK)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                              env=env, cwd=tmp_path)
    hogs: list[subprocess.Popen] = []
    try:
        for b in range(BLOCKS):
            _expect(worker, f"BLOCK {b}", err)
            if b % 2 == 1:
                hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(max(1, cores // 2))]
                time.sleep(0.5)  # the hog is running before the block starts
            worker.stdin.write("go\n")
            worker.stdin.flush()
            _expect(worker, f"DONE {b}", err)
            _stop(hogs)
            hogs = []
        result = json.loads(_expect(worker, "RESULT ", err)[len("RESULT "):])
        worker.wait(timeout=120)
    finally:
        _stop(hogs)
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        err.close()
    times = result["times"]
    quiet = sorted(t for b in range(0, BLOCKS, 2) for t in times[b])
    hogged = sorted(t for b in range(1, BLOCKS, 2) for t in times[b])
    med = lambda xs: xs[len(xs) // 2]  # noqa: E731
    ratio = med(hogged) / med(quiet)
    print(f"quiet median {med(quiet):.3f} s, hogged median {med(hogged):.3f} s, ratio {ratio:.2f} "
          f"({cores} cores, {result['threads']} threads, load {os.getloadavg()[0]:.1f})")
    assert ratio < 3.0, f"a step under a {max(1, cores // 2)}-process CPU hog took {ratio:.1f}x the quiet step (quiet {quiet}, hogged {hogged})"


def _expect(worker: subprocess.Popen, prefix: str, err) -> str:
    """The worker's next stdout line starting with ``prefix`` (fails with its stderr if it exits)."""
    for line in worker.stdout:
        if line.startswith(prefix):
            return line.strip()
    err.seek(0)
    raise AssertionError(f"worker exited before {prefix!r}: {err.read()[-3000:]}")


def _stop(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        if h.poll() is None:
            h.kill()
    for h in hogs:
        h.wait()
