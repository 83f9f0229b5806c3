"""trainer.mode=streamed: an on-policy step whose update starts on the prompt groups that are complete.

    rollout worker (weights after step k - 1)      driver                     ranks
      samples step k's prompts, and as each     ->  scores the group,
      group's samples have all ended, yields it     keeps it (DAPO: unless
                                                    its rewards are all one),
                                                    and every stream_chunk_groups
                                                    groups: advantages   ->  forward + backward of
      ...decodes the rest meanwhile                                          the chunk, gradients summed
      last group                                ->  the last chunk      ->  divide by the batch's count,
                                                                             clip, optimizer step
    then the weights after step k go to the worker (trainer.py), and step k + 1 samples with them.

Every sample is of the weights being trained (staleness 0), as in sync mode; what changes is that
the ranks no longer idle through the decode's long tail: they train on the groups that ended
early while the worker decodes the rest (on separate GPUs, where the rollout worker has its own).

The gradient is the whole batch's. The loss is a mean over the batch's response tokens (or its
sequences, algorithm.loss_agg_mode), a count known only once the last group has ended, so each
chunk's loss is taken as a sum (both counts 1) and the summed gradients and metrics are divided by
the real counts before clipping (engine/backends/base.py ``stream_finish``). That is exact for
estimators whose advantages depend only on a sample's own group (GRPO, DAPO, Dr. GRPO, RLOO); the
others, PPO's critic and several optimizer steps per batch are refused (engine/config/async_rules.py).

DAPO's dynamic sampling streams too: a group whose rewards are all equal is set aside as it
arrives, kept groups go to the ranks until the batch holds data.train_batch_size of them, and when
a round ends short the worker samples further prompts (as engine/algorithms/dynamic_sampling.py
does for a whole batch); after algorithm.dynamic_sampling_max_rounds the set-aside groups top it up.

The order groups end in depends only on the samples, and the worker's sampling is seeded, so a
streamed run is reproducible; it is not the sync run (another sampling stream, another summation
order). Checkpoints hold no rollout in flight: a step's stream ends before its checkpoint.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.config.resolved import stream_chunk_groups
from engine.config.schema import RunConfig

if TYPE_CHECKING:
    from engine.algorithms.dynamic_sampling import Rollout
    from engine.trainer.data import PromptStream
    from engine.trainer.rollout_ahead import RolloutAhead
    from engine.trainer.setup import RunInputs
    from engine.trainer.trainer import Updated


class ChunkSender:
    """Groups in, chunks out: every ``size`` kept groups become one chunk, which gets its
    reference log-probs (KL) and advantages and goes to the ranks at once."""

    def __init__(self, cfg: RunConfig, workers, size: int, pad: int):
        self.cfg, self.workers, self.size, self.pad = cfg, workers, size, pad
        self.pending: list[Rollout] = []
        self.sent: list[Rollout] = []
        self.ref_s = 0.0
        self.first_sent_at: float | None = None

    def add(self, group: Rollout) -> None:
        self.pending.append(group)
        if len(self.pending) >= self.size:
            self.flush()

    def flush(self) -> None:
        from engine.algorithms.dynamic_sampling import Rollout
        from engine.algorithms.estimators import compute_advantages

        if not self.pending:
            return
        part, self.pending = Rollout.concat(self.pending, self.pad), []
        b, a = part.batch, self.cfg.algorithm
        kl = None
        if a.kl_coef > 0:
            from engine.algorithms.policy_loss import batch_kl

            t = time.perf_counter()
            b.ref_log_probs = self.workers.log_probs(b, ref=True)  # behind the chunks already sent
            self.ref_s += time.perf_counter() - t
            kl = batch_kl(b, a.kl_type)
        est = compute_advantages(a, part.rewards, b.response_mask, a.rollout_n, kl=kl,
                                 max_len=self.cfg.rollout.max_new_tokens)
        b.advantages, b.returns = est.advantages, est.returns
        if self.first_sent_at is None:
            self.first_sent_at = time.perf_counter()
        self.workers.stream_chunk(b)
        self.sent.append(part)


def streamed_step(cfg: RunConfig, inputs: RunInputs, workers, stream: PromptStream, step: int,
                  ahead: RolloutAhead, timing: dict, gen_stats: list, scores: list) -> Updated:
    """Steps 1-5 of ``step`` with the update streamed (the module's docstring). Adds to ``timing``:
    ``rollout`` (the worker's own sampling time), ``reward`` (scoring, on the driver, between the
    groups' arrivals), ``update`` (from the first chunk sent to the optimizer step's end) and
    ``update_after_rollout`` (what the step still waited for the ranks once the last group had come)."""
    from engine.algorithms.dynamic_sampling import DynamicSamplingStats, Rollout, next_draw_size
    from engine.algorithms.policy_loss import batch_kl
    from engine.algorithms.estimators import compute_advantages, zero_variance_groups
    from engine.trainer.trainer import Updated, score_rollout

    a = cfg.algorithm
    n, target = a.rollout_n, cfg.data.train_batch_size
    dynamic = a.dynamic_sampling
    chunks = ChunkSender(cfg, workers, stream_chunk_groups(cfg), inputs.vocab["pad"])
    set_aside: list[Rollout] = []  # DAPO: groups whose rewards are all equal, kept for a top-up
    versions: set[int] = set()
    kept = drawn = good = rounds = 0
    k = target
    reward_s = 0.0
    workers.stream_begin()
    while kept < target and rounds < 1 + (a.dynamic_sampling_max_rounds if dynamic else 0):
        pieces = ahead.stream_groups(k)
        idx, seen = next(pieces)
        for item in pieces:
            if isinstance(item, dict):  # the worker's stats: the round is over
                gen_stats.append(item)
                versions.add(item["version"])
                timing["rollout"] = timing.get("rollout", 0.0) + item["time"]
                continue
            pos, rows = item
            t = time.perf_counter()
            sc = score_rollout(cfg, inputs, stream.n, idx[pos:pos + len(rows) // n], seen, rows, step)
            reward_s += time.perf_counter() - t
            scores.append(sc.scored)
            piece = Rollout(rows, sc.rewards, sc.scored.correct, sc.examples)
            flat = zero_variance_groups(sc.rewards, n).tolist() if dynamic else [False] * (len(rows) // n)
            for g, zero in enumerate(flat):
                group = piece.groups([g], n)
                if zero:
                    set_aside.append(group)
                    continue
                good += 1
                if kept < target:  # (a surplus group of the last round is dropped, as dynamic_sample does)
                    chunks.add(group)
                    kept += 1
        rounds += 1
        drawn += k
        k = next_draw_size(target, kept, good, drawn)
    last_group_at = time.perf_counter()
    padded = min(target - kept, len(set_aside))
    for group in set_aside[:padded]:  # out of rounds: groups that carry no signal fill the batch
        chunks.add(group)
    chunks.flush()
    ro = Rollout.concat(chunks.sent, inputs.vocab["pad"])
    result = workers.stream_finish(float(ro.batch.response_mask.sum()), float(len(ro.batch)))
    end = time.perf_counter()
    if len(versions) != 1:
        raise RuntimeError(f"one streamed step's rounds were sampled with different policy versions: "
                           f"{sorted(versions)}")
    ro.versions = [versions.pop()] * len(ro.batch)

    # the whole batch's advantages are the chunks' (each group's own), computed again for the metrics
    est = compute_advantages(a, ro.rewards, ro.batch.response_mask, n,
                             kl=batch_kl(ro.batch, a.kl_type) if a.kl_coef > 0 else None,
                             max_len=cfg.rollout.max_new_tokens)
    timing["reward"] = timing.get("reward", 0.0) + reward_s
    timing["log_probs"] = chunks.ref_s
    timing["update"] = end - (chunks.first_sent_at or end)
    timing["update_after_rollout"] = end - last_group_at
    sampling = DynamicSamplingStats(rounds, drawn, good / drawn, padded) if dynamic else None
    kl_reward = est.metrics.get("kl_reward") if a.kl_coef > 0 and not a.use_kl_loss else None
    return Updated(ro, sampling, est, [result], kl_reward=kl_reward)

