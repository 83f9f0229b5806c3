#!/usr/bin/env bash
# rl's rollout and update beside a plain HF loop, 135m and 0.5b shapes, bf16 (bench/gpu_bench.py, issue 41).
#     bash bench/gpu_check_bench.sh      # GPU_CHECK_TIMEOUT=300 from bench/gpu_check.sh
# Writes ${OUT:-/tmp}/gpu_bench.json. Exit 0 passed, 2 skipped (no CUDA device), 1 failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "MISSING: a CUDA device (torch.cuda.is_available() is False)"; exit 2
fi
# the log-prob pass at the 0.5b shape's vocabulary (Qwen2.5's 151,936) and a GPU-sized micro-batch:
# chunked (rl) beside the plain log_softmax, the allocator's peak and the time of forward + backward
rc=0
timeout 40 python3 bench/logprob_memory.py --device cuda --tokens 8192 --vocab 151936 --hidden 896 --dtypes bfloat16 \
  --json "${OUT:-/tmp}/logprob_memory.json" || rc=1
timeout $(( ${GPU_CHECK_TIMEOUT:-300} - 45 )) python3 bench/gpu_bench.py --device cuda --steps 2 \
  --json "${OUT:-/tmp}/gpu_bench.json" || rc=1
[ "$rc" = 0 ] || exit 1
