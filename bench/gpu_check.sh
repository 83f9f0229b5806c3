#!/usr/bin/env bash
# The GPU checks, as one script for a lent device (one H200, about 12 minutes in all).
# Run from anywhere:  bash bench/gpu_check.sh
#   1. memory:   offload/onload on CUDA, TE FP8 workspaces before/after offload with and
#                without clearing (bench/gpu_check_memory.sh)
#   2. megatron: TE layer spec, bf16 and FP8 forward/backward, offload with workspace
#                clearing (bench/gpu_check_megatron.sh)
#   3. vllm:     sleep/wake around an update, KV-cache and non-torch memory
#                (bench/gpu_check_vllm.sh)
#   4. activation offload: peak memory and step time with and without, long sequence
#                (bench/gpu_check_activation_offload.sh)
#   5. pytest:   the `gpu`-marked tests in tests/test_gpu.py other than the three scripts above
#                (which that file also wraps, for `pytest -m gpu`)
# Each part prints its own figures; exit codes per part: 0 passed, 2 skipped (a dependency is
# missing, printed as MISSING), 1 failed. This script exits 1 if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
run() {  # name, seconds, script
  echo "=================== $1 (limit $2 s) ==================="
  GPU_CHECK_TIMEOUT="$2" timeout "$2" bash "$3"
  rc=$?
  echo "--- $1: exit $rc"
  [ "$rc" = 1 ] || [ "$rc" = 124 ] && status=1
  return 0
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
run memory 170 bench/gpu_check_memory.sh
run megatron 200 bench/gpu_check_megatron.sh
run vllm 180 bench/gpu_check_vllm.sh
run activation_offload 150 bench/gpu_check_activation_offload.sh
echo "=================== pytest -m gpu (limit 120 s) ==================="
timeout 120 python3 -m pytest -q -m gpu -rs tests/test_gpu.py -k "not gpu_check_script" || status=1
exit $status
