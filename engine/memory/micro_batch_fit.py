"""``engine.max_tokens_per_micro_batch=0``: the token budget per micro-batch fitted to the device.

A hand-set budget is either too small (the GPU idles on small matmuls: fewer tokens per kernel,
more passes) or too large (out of memory at the first long batch). verl asks its users for
``ppo_max_token_len_per_gpu`` and TRL for a per-device batch size; both are guesses about memory.
Here the rank that trains picks the largest budget whose estimated peak (engine/memory/estimate.py)
in the phases the micro-batch decides (the log-prob passes and the update, whose activations and
logits grow with it; not the rollout, whose KV cache does not) stays within ``engine.micro_batch_memory_fraction`` of the memory it has:

- on a GPU, what ``torch.cuda.mem_get_info`` reports free when the rank starts (another process
  on the device is already out of it), less, on the first rank, what a rollout worker that will
  share its GPU holds (``shared_worker_bytes``: the worker starts after the fit and samples
  during the update); a colocated vLLM engine sleeps through the update and is not counted;
- on a CPU, the host's available memory (``/proc/meminfo`` MemAvailable) shared by the ranks on
  that host.

Budgets are whole sequences of the longest padded length (the estimate's shape: a micro-batch of
shorter rows holds more of them in the same tokens, and needs no more memory), from one
sequence up to the whole mini-batch. Every rank takes the smallest budget any rank fitted, so
all split the same way. When even one sequence does not fit, the run stops before it builds
anything, saying by how much and what to change.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from engine.config.schema import RunConfig
from engine.errors import UserError

UNFITTED_BUDGET = 4096  # what the estimate shows for budget 0 when it does not know the device
# the phases whose memory the micro-batch decides (the rollout's KV cache and weight sync do not)
BUDGET_PHASES = ("old_log_probs", "ref_log_probs", "update", "critic_update")


@dataclass
class FittedBudget:
    tokens: int          # the engine.max_tokens_per_micro_batch the run uses
    micro_seqs: int      # sequences of the longest padded length per micro-batch
    seq_len: int         # that length
    peak_bytes: int      # the estimated peak per rank at this budget
    peak_phase: str
    limit_bytes: int     # engine.micro_batch_memory_fraction x device_bytes
    device_bytes: int
    whole_mini_batch: bool  # the budget holds the whole mini-batch: more memory would not change it
    worker_bytes: int = 0   # taken out of device_bytes first: a rollout worker sharing the GPU

    def describe(self) -> str:
        from engine.memory.estimate import _fmt

        return (f"{self.tokens} (fitted: {self.micro_seqs} x {self.seq_len} tokens, estimated peak "
                f"{_fmt(self.peak_bytes)} in {self.peak_phase} of {_fmt(self.limit_bytes)} allowed"
                + (f", after the {_fmt(self.worker_bytes)} of the rollout worker sharing this GPU"
                   if self.worker_bytes else "")
                + (", the whole mini-batch" if self.whole_mini_batch else "") + ")")


def _estimate_at(st, run_cfg: RunConfig, micro_seqs: int, seq_len: Optional[int], attn_implementation: str):
    """The estimate at ``micro_seqs`` sequences per micro-batch, with ``"peak"`` the largest of
    the phases the micro-batch decides."""
    from engine.memory.estimate import _compute

    cfg = copy.deepcopy(run_cfg)
    cfg.engine.micro_batch_size = micro_seqs
    e = cfg.engine
    r = _compute(st, cfg, seq_len=seq_len, device_memory_bytes=None, attn_implementation=attn_implementation,
                 param_offload=e.param_offload, optimizer_offload=e.optimizer_offload,
                 activation_offload=e.activation_offload)
    r["peak"] = max((p for p in r["phases"] if p.phase in BUDGET_PHASES), key=lambda p: p.total)
    return r


def shared_worker_bytes(run_cfg: RunConfig, st, device_total_bytes: int, attn_implementation: str = "sdpa") -> int:
    """What the rollout worker holds on a GPU it shares with the first rank (a mode that samples
    ahead, no GPU free for it: engine/trainer/rollout_ahead.py), all of it while that rank updates,
    since the worker samples the next batch then: its copy of the policy, the whole batch's KV
    cache (vLLM: its pool, ``rollout.gpu_memory_utilization`` of ``device_total_bytes`` with the
    weights) and the sampling logits, as ``rl mem-report`` estimates them. 0 when nothing samples
    ahead. The worker starts after the ranks have fitted their budget, so the free memory they
    measure does not have it out yet."""
    from engine.memory.estimate import _compute

    e = run_cfg.engine
    worker = _compute(st, run_cfg, seq_len=None, device_memory_bytes=device_total_bytes,
                      attn_implementation=attn_implementation, param_offload=e.param_offload,
                      optimizer_offload=e.optimizer_offload, activation_offload=e.activation_offload)["worker"]
    return int(worker["total"]) if worker else 0


def fit_token_budget(run_cfg: RunConfig, st, device_bytes: int, *, seq_len: Optional[int] = None,
                     attn_implementation: str = "sdpa", worker_bytes: int = 0) -> FittedBudget:
    """The largest budget (whole sequences of the longest padded length, at most the mini-batch)
    whose estimated peak is within ``engine.micro_batch_memory_fraction`` of ``device_bytes``
    less ``worker_bytes`` (a rollout worker that will share the GPU: ``shared_worker_bytes``);
    ``st``: engine.memory.estimate.model_structure(...). UserError when one sequence does not fit."""
    limit = int(max(0, device_bytes - worker_bytes) * run_cfg.engine.micro_batch_memory_fraction)
    one = _estimate_at(st, run_cfg, 1, seq_len, attn_implementation)
    sh = one["shapes"]
    if one["peak"].total > limit:
        from engine.memory.estimate import _fmt

        vllm = run_cfg.rollout.name == "vllm"
        share = f"rollout.gpu_memory_utilization={run_cfg.rollout.gpu_memory_utilization}"
        worker = (f" less the {_fmt(worker_bytes)} the rollout worker sharing this GPU will hold (its copy of the "
                  f"policy, KV cache{f' in the vLLM pool of {share}' if vllm else ''} and logits; give it a GPU of "
                  f"its own, one more than the ranks use{f', or lower {share}' if vllm else ''})"
                  if worker_bytes else "")
        raise UserError(
            f"engine.max_tokens_per_micro_batch=0 fits the micro-batch to the memory this rank has, but even one "
            f"sequence of {sh.seq_len} tokens gives an estimated peak of {_fmt(one['peak'].total)} "
            f"(in {one['peak'].phase}), over the {_fmt(limit)} allowed "
            f"(engine.micro_batch_memory_fraction={run_cfg.engine.micro_batch_memory_fraction} of "
            f"{_fmt(device_bytes)}{worker}). `rl mem-report --estimate` with this run's overrides ranks what "
            f"helps (gradient checkpointing, offload, more ranks, shorter sequences).",
            title="the micro-batch does not fit")
    lo, hi = 1, max(1, sh.mini_batch_seqs)  # lo fits; find the largest k that does
    best = one
    while lo < hi:
        mid = (lo + hi + 1) // 2
        r = _estimate_at(st, run_cfg, mid, seq_len, attn_implementation)
        if r["peak"].total <= limit:
            lo, best = mid, r
        else:
            hi = mid - 1
    return FittedBudget(tokens=lo * sh.seq_len, micro_seqs=lo, seq_len=sh.seq_len, peak_bytes=best["peak"].total,
                        peak_phase=best["peak"].phase, limit_bytes=limit, device_bytes=int(device_bytes),
                        whole_mini_batch=lo >= sh.mini_batch_seqs, worker_bytes=int(worker_bytes))
