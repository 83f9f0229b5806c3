"""Sampling ahead of the update (trainer.mode=one_step_off|async), driven from the trainer.

Versions: the policy is version 0 before any update and version ``k`` after step ``k``'s update,
so the synchronous trainer trains step ``k`` on samples of version ``k - 1``. A sample's
*staleness* is how many versions older than that it is: ``(k - 1) - version``.

The schedule, with ``ahead`` = 1 (one_step_off) or trainer.max_staleness (async):

    step k:  take the batch queued for k (or sample it now when none is queued: step 1, and
             dynamic sampling's extra rounds), then queue batches for steps k+1 .. k+ahead, which
             the rollout worker samples while the ranks update; after the update, load version k
             into the rollout worker (behind the batches already asked for).

A batch queued at step k for step j was asked for after version k - 1 was loaded, so its staleness
is at most j - k <= ahead; every batch records the version it was actually sampled with. With
``ahead`` = 0 nothing is queued and the trainer never builds this (the sync path, exactly).

Rewards as batches arrive: a queued batch is scored on a driver thread as soon as the worker returns
it (``score_with``), while the ranks still update, with the trainer state of the step expected to
train on it; the step then only waits for what is left. A batch sampled at the step that trains on
it (step 1, dynamic sampling's extra rounds), or taken by another step than expected, is scored on
that thread too, ahead of the next batches: reward functions see the steps in order.

Multi-turn rollouts (task.tools, task.environment): the agent loop runs on the driver, on one
thread (``rl-episodes``), each model turn a ``generate`` call on the worker, the tools and the
environment between turns where they run in sync mode. Every call on the worker -- the episodes'
turns and the weight loads -- is made from that thread in the order the schedule asked for them,
so every turn of a batch is sampled with the weights that a single-turn batch asked at the same
moment would have had, whatever the timing, and the run is reproducible.

Checkpoints: ``state_dict`` waits for the queued batches and returns them with the worker's
sampling generator, so a resumed run trains on the same samples and continues the same stream
(exact resume, as in sync mode)."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from engine.config.resolved import resolve_run, versions_ahead
from engine.config.schema import RunConfig
from engine.trainer.ray_cluster import get
from engine.trainer.rollout_worker import RolloutWorker

if TYPE_CHECKING:
    from engine.batch import SequenceBatch
    from engine.trainer.data import PromptStream
    from engine.trainer.worker_group import WorkerGroup


@dataclass
class Draw:
    """Prompts drawn from the stream and their batch, asked of the rollout worker."""

    indices: list[int]      # prompt indices in the stream's order
    samples_seen: int       # the stream's count once they were drawn (what reward functions see)
    pending: object = None  # the worker's ObjectRef until taken
    batch: SequenceBatch | None = None
    stats: dict | None = None
    for_step: int = 0                # the step expected to train on it (0: not known when asked)
    scoring: Future | None = None    # its rewards, computed on the driver's scoring thread
    arrived: float = 0.0             # perf_counter when the scoring thread had the batch

    def wait(self, timeout_s: float) -> "Draw":
        if self.batch is None:
            if isinstance(self.pending, Future):  # multi-turn episodes, on the rl-episodes thread
                self.batch, self.stats = self.pending.result()  # (each turn's call has its own timeout)
            else:
                self.batch, self.stats = get(self.pending, timeout_s, "the rollout worker's rollout")
            self.pending = None
        return self


def rollout_worker_gpus(workers: WorkerGroup, free_gpus: float) -> int:
    """A GPU of its own for the rollout worker when the ranks run on GPUs and the cluster has one
    free once the ranks hold theirs (``free_gpus``: Ray's available GPUs, not its total, so a GPU
    another job or actor holds is not waited for); else 0 (on GPUs: it shares the first rank's
    device, as a colocated sampler does: ``shared_gpu_placement``)."""
    on_gpu = bool(workers.info) and workers.info[0]["device"].startswith("cuda")
    return 1 if on_gpu and free_gpus >= 1 else 0


def shared_gpu_placement(workers: WorkerGroup, env: dict) -> dict:
    """Actor options that put a rollout worker with no GPU of its own on the first rank's node and
    GPU. An actor asking for no GPU is scheduled anywhere (the driver's node first, which may have
    no GPU) and sees every GPU of its node (Ray leaves CUDA_VISIBLE_DEVICES alone then), so cuda:0
    would be whichever GPU is first there. Pinned to rank 0's node, with CUDA_VISIBLE_DEVICES set to
    the GPU Ray assigned rank 0 (and Ray told not to rewrite it), its cuda:0 is that GPU."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    first = workers.placement[0] if workers.placement else {}
    env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    if first.get("gpu_ids"):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(first["gpu_ids"][:1])
    options: dict = {"runtime_env": {"env_vars": env}}
    if first.get("node_id"):
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(first["node_id"], soft=False)
    return options


def merge_turn_stats(calls: list[dict], seconds: float) -> dict:
    """One stats record for a batch of multi-turn episodes from its turns' ``generate`` records:
    ``time`` the episodes' wall time (tools and environment included, as a sync rollout counts
    them), peaks kept, and the one version every turn was sampled with."""
    versions = {c["version"] for c in calls}
    if len(versions) != 1:
        raise RuntimeError(f"one batch's turns were sampled with different policy versions: {sorted(versions)}")
    out = {k: max(c[k] for c in calls) for k in ("kv_cache_bytes", "rss_peak") if all(k in c for c in calls)}
    return {**out, "time": seconds, "version": versions.pop(), "turn_calls": len(calls)}


class RolloutAhead:
    def __init__(self, cfg: RunConfig, workers: WorkerGroup, stream: PromptStream, train_prompts: list[list[int]],
                 episodes: Callable | None = None):
        import ray

        from engine.threads import rank_env, usable_cpus

        self.cfg, self.workers, self.stream, self.prompts = cfg, workers, stream, train_prompts
        self.ahead = versions_ahead(cfg)
        self.n = cfg.algorithm.rollout_n
        self.timeout = cfg.trainer.ray_timeout_s
        self.queue: list[Draw] = []
        self._score: Callable | None = None   # score(draw, step) -> what the trainer keeps of a scored batch
        self._scoring: ThreadPoolExecutor | None = None
        # multi-turn: episodes(generate, prompts, prompt indices) -> the batch, the agent loop with
        # generate(prompts, n) one turn on the worker; every worker call then goes through one thread
        self.episodes = episodes
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-episodes") if episodes else None
        self.score_wait_s = 0.0
        self.sync_s = 0.0  # the last weight load's export + hand-over, on the driver's clock
        threads = max(1, usable_cpus() // (cfg.trainer.nprocs + 1))
        gpus, env = rollout_worker_gpus(workers, ray.available_resources().get("GPU", 0)), rank_env(threads)
        options = {"runtime_env": {"env_vars": env}}
        self.shares_gpu = gpus == 0 and bool(workers.info) and workers.info[0]["device"].startswith("cuda")
        if self.shares_gpu:
            options = shared_gpu_placement(workers, env)  # no GPU left for it: the first rank's
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(RolloutWorker)
        self.actor = actor.options(**options).remote(resolve_run(cfg), threads)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, model_path: str, vocab: dict, version: int) -> None:
        """Build the worker's sampler from the ranks' current weights (policy ``version``)."""
        weights = self.workers.export_weights(self.shares_gpu)
        device = "cuda" if self.workers.info[0]["device"].startswith("cuda") else "cpu"
        get(self.actor.setup.remote(model_path, vocab, weights, version, device, self.shares_gpu), self.timeout,
            "the rollout worker to start")

    def score_with(self, score: Callable) -> None:
        """Score each batch with ``score(draw, step)`` on a driver thread as soon as the worker
        returns it (one thread: batches are scored in the order they were asked for, and
        reward functions are never called by two threads at once)."""
        self._score = score
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-score-ahead")

    def shutdown(self) -> None:
        import ray

        threads = [t for t in (self._calls, self._scoring) if t is not None]
        for t in threads:  # nothing new starts; a call waiting on the worker ends when it goes
            t.shutdown(wait=False, cancel_futures=True)
        try:
            get(self.actor.shutdown.remote(), 30, "the rollout worker to stop")
        except Exception:
            pass
        ray.kill(self.actor)
        for t in threads:
            t.shutdown(wait=True)

    # ---- the schedule ------------------------------------------------------------------------
    def take(self, k: int, step: int = 0,
             queue_next: bool = False) -> tuple[list[int], int, SequenceBatch, dict, object]:
        """The next ``k`` prompts' batch for ``step``: the one queued when it has ``k`` prompts,
        else sampled now. Returns (prompt indices, samples seen once drawn, batch, stats with
        ``version``, what ``score`` returned for it at ``step`` or None: not scored yet).

        ``queue_next``: ask for the next steps' batches (``queue_ahead``) before waiting for this
        one and its rewards. They are sampled with the same weights either way (the last version
        loaded, before this step's update) and asked in the same order, so the run is the same;
        the worker just starts them while this batch is still being scored, instead of idling
        until the step has its rewards (docs/async.md, "The schedule")."""
        if self.queue and len(self.queue[0].indices) == k:
            d = self.queue.pop(0)
        else:
            d = self._ask(k)
        if self._score is not None and step and not (d.scoring is not None and d.for_step == step):
            # not scored for this step: on the scoring thread too, before the next batches are asked
            # (and their scoring queued), so reward functions see the steps in order
            d.for_step, d.scoring = step, self._scoring.submit(self._score_when_sampled, d, step)
        if queue_next:
            self.queue_ahead(step)
        self.score_wait_s = 0.0  # what this take waited for the batch's scoring to finish
        scored, t0 = None, time.perf_counter()
        if d.scoring is not None:
            wait_all([d.scoring])
            self.score_wait_s = max(0.0, time.perf_counter() - max(t0, d.arrived))  # from the batch's arrival
        d.wait(self.timeout)  # (when the scoring thread's own wait failed: its error, raised here)
        if d.scoring is not None and d.for_step == step:
            scored = d.scoring.result()  # a reward error is raised here
        return d.indices, d.samples_seen, d.batch, d.stats, scored

    def queue_ahead(self, step: int = 0) -> None:
        """Ask for the batches of the next ``ahead`` steps after ``step`` (sampled while the ranks
        update), each scored as soon as it arrives when ``score_with`` was given a scorer."""
        while len(self.queue) < self.ahead:
            d = self._ask(self.cfg.data.train_batch_size)
            self.queue.append(d)
            if self._score is not None and step and step + len(self.queue) <= self.cfg.trainer.total_steps:
                d.for_step = step + len(self.queue)  # (a batch past the last step is kept for a resume, not scored)
                d.scoring = self._scoring.submit(self._score_when_sampled, d, d.for_step)

    def stream_groups(self, k: int):
        """trainer.mode=streamed: the next ``k`` prompts, sampled now with the weights loaded last.
        Yields ``(prompt indices, samples seen once drawn)`` first, then each prompt group as
        ``(position in the prompts, SequenceBatch)`` as soon as its samples have ended, and last
        the worker's stats (with ``version``)."""
        import ray

        from engine.trainer.ray_cluster import timeout_error

        idx = self.stream.next_indices(k)
        yield idx, self.stream.pos.samples_seen
        gen = self.actor.generate_stream.options(num_returns="streaming").remote([self.prompts[i] for i in idx],
                                                                                 self.n)
        while True:
            ready, _ = ray.wait([gen], num_returns=1, timeout=self.timeout)
            if not ready:
                raise timeout_error(self.timeout, "the rollout worker's rollout")
            try:
                ref = next(gen)
            except StopIteration:
                return
            item = get(ref, self.timeout, "the rollout worker's rollout")
            yield item if isinstance(item, dict) else (item[0] // self.n, item[1])

    def _score_when_sampled(self, d: Draw, step: int):
        d.wait(self.timeout)
        d.arrived = time.perf_counter()
        return self._score(d, step)

    def _ask(self, k: int) -> Draw:
        idx = self.stream.next_indices(k)
        prompts = [self.prompts[i] for i in idx]
        if self._calls is not None:
            return Draw(idx, self.stream.pos.samples_seen, self._calls.submit(self._run_episodes, prompts, idx))
        return Draw(idx, self.stream.pos.samples_seen, self.actor.generate.remote(prompts, self.n))

    def _run_episodes(self, prompts: list[list[int]], idx: list[int]):
        """On the rl-episodes thread: the agent loop over ``prompts``, each turn sampled on the worker."""
        calls: list[dict] = []

        def turn(turn_prompts: list[list[int]], n: int):
            batch, stats = get(self.actor.generate.remote(turn_prompts, n), self.timeout,
                               "the rollout worker's rollout")
            calls.append(stats)
            return batch

        t0 = time.perf_counter()
        batch = self.episodes(turn, prompts, idx)
        return batch, merge_turn_stats(calls, time.perf_counter() - t0)

    def load_version(self, version: int) -> None:
        """After an update: the ranks' weights to the worker, behind what it was already asked
        (multi-turn: behind the episodes already asked for, each of whose turns use the older weights)."""
        t0 = time.perf_counter()
        weights = self.workers.export_weights(self.shares_gpu)
        if self._calls is not None:
            self._calls.submit(self.actor.load_weights.remote, weights, version)
        else:
            self.actor.load_weights.remote(weights, version)
        self.sync_s = time.perf_counter() - t0

    # ---- checkpoints -------------------------------------------------------------------------
    def queued_prompts(self) -> int:
        return sum(len(d.indices) for d in self.queue)

    def state_dict(self) -> dict:
        """The queued batches (waited for) and the worker's sampling generator after them."""
        rows = []
        for d in self.queue:
            if d.scoring is not None:
                wait_all([d.scoring])  # the scoring thread is done with it (its rewards are not saved)
            d.wait(self.timeout)
            rows.append({"indices": list(d.indices), "samples_seen": d.samples_seen, "stats": dict(d.stats),
                         "batch": {name: getattr(d.batch, name) for name in d.batch.tensor_fields()}})
            if "agent" in d.batch.extras:  # multi-turn: the conversations and what scoring reads of them
                rows[-1]["agent"] = json.dumps(d.batch.extras["agent"], default=str)
        return {"queue": rows, "generator": get(self.actor.rng_state.remote(), self.timeout,
                                                "the rollout worker's state")}

    def load_state_dict(self, state: dict) -> None:
        from engine import json_safe
        from engine.batch import SequenceBatch

        self.queue = [Draw(r["indices"], r["samples_seen"], None,
                           SequenceBatch(**r["batch"], extras={"agent": json_safe.loads(r["agent"])} if "agent" in r else {}),
                           r["stats"])
                      for r in state["queue"]]
        get(self.actor.set_rng_state.remote(state["generator"]), self.timeout, "the rollout worker's state")
