"""`train()`: the GRPO loop, readable top to bottom.

    rollout (ranks sample n responses per prompt)  ->  reward (driver, task's rule)
    -> advantages (GRPO, per prompt group)  ->  reference / old log-probs (ranks)
    -> policy update (ranks, PPO-clip, micro-batched)  ->  metrics, checkpoint

The ranks are launched before the driver loads torch: this module imports it (and the
algorithms that need it) inside the functions that use it, and ``_run`` loads them while the
ranks start (engine/trainer/worker_group.py).
"""

from __future__ import annotations

import shutil
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine import json_safe
from engine.algorithms.alarms import AlarmMonitor
from engine.checkpoint.layout import TMP_PREFIX, step_dir_name
from engine.algorithms.staleness import rollout_ratio_metrics, staleness_record, versions_behind
from engine.config.resolved import mini_batch_prompts, updates_per_step, uses_rollout_worker, versions_ahead
from engine.config.schema import RunConfig
from engine.data.fingerprint import write_record as write_dataset_record
from engine.errors import UserError
from engine.memory.oom import OutOfMemory, answer, oom_guard
from engine.metric_sums import add_metrics, mean_over_updates
from engine.rewards.compute import RewardError, samples_of
from engine.trainer.ray_cluster import WorkerLost
from engine.tracking.eta import StepClock
from engine.tracking.fanout import Tracking
from engine.tracking.progress import phase, tree_bytes
from engine.tracking.samples import is_sample_step, pick_rows
from engine.trainer.data import PromptStream
from engine.trainer.resume import carry_out
from engine.events import RunPlan, RunSummary, StepRecord, Validation
from engine.trainer.run_dir import RunDir
from engine.trainer.setup import RunInputs

if TYPE_CHECKING:
    from engine.algorithms.dynamic_sampling import Rollout
    from engine.batch import SequenceBatch


def train(cfg: RunConfig, run_dir: Path, *, overrides: list[str] | None = None, changed: dict | None = None,
          on_event: Callable[[object], None] = lambda e: None, resume=None,
          env_refs: dict | None = None) -> RunSummary:
    """Run ``cfg`` end to end (or continue ``resume``, a engine.checkpoint.plan.ResumePlan,
    carried out by engine/trainer/resume.py).

    Every event goes to ``on_event`` (the CLI) and, for what is logged, to the configured
    loggers (engine/tracking/): metrics.jsonl, samples.jsonl, TensorBoard, wandb, MLflow.
    Preflight, the run-directory lock and failure clean-up: engine/trainer/run_guard.py."""
    from engine.trainer.run_guard import guarded_run

    with guarded_run(cfg, Path(run_dir), overrides=list(overrides or []), resume=resume, env_refs=env_refs,
                     on_event=on_event) as (rdir, inputs):  # inputs: task, tokenizer, encoded prompts, model path
        return _run(cfg, run_dir, rdir, inputs, changed=changed, on_event=on_event, resume=resume)


def _run(cfg: RunConfig, run_dir: Path, rdir: RunDir, inputs: RunInputs, *, changed: dict | None,
         on_event: Callable[[object], None], resume) -> RunSummary:
    t_start = time.perf_counter()
    tracking = None
    write_dataset_record(rdir.path, inputs.task.data_info)  # `rl resume` refuses changed data
    logged_through = last_logged_step(run_dir) if resume is not None else -1  # before resume truncates
    stream = PromptStream(len(inputs.train_prompts), cfg.trainer.seed, cfg.data.shuffle)
    start_step = 0

    def emit(e) -> None:  # logged events: loggers first, then the CLI
        tracking.on_event(e)
        on_event(e)

    from engine.trainer.ray_cluster import ray_cluster
    from engine.trainer.worker_group import WorkerGroup

    failed = True
    workers = None
    try:
        if resume is None:
            tracking = Tracking(cfg, run_dir)  # loggers open in the background while the ranks start
        ahead = None  # trainer.mode=one_step_off|async: the rollout worker's schedule (engine/trainer/rollout_ahead.py)
        with ray_cluster(cfg.trainer.ray_address, num_cpus=cfg.trainer.nprocs + 1 + uses_rollout_worker(cfg),
                         connect_timeout_s=cfg.trainer.ray_connect_timeout_s) as (_, ray_target):
            with phase(on_event, "load_model", _load_label(cfg, inputs), total_bytes=_model_bytes(inputs.model_path)):
                workers = WorkerGroup(cfg, run_dir)  # launched: each rank starts and imports torch
                try:
                    _load_step_modules()  # the driver's own imports, meanwhile
                    workers.start(inputs.model_path, inputs.vocab)
                except BaseException:
                    workers.shutdown(graceful=False)
                    raise
            try:
                if resume is not None:
                    step_dir = Path(resume.step_dir)
                    with phase(on_event, "load_checkpoint", f"load checkpoint {step_dir.name}",
                               total_bytes=tree_bytes(step_dir)):
                        start_step = carry_out(resume, workers, stream)
                    tracking = Tracking(cfg, run_dir, resume_step=start_step, logged_through=logged_through)
                rdir.carry_rows_after(start_step if resume is not None else -1)  # the next checkpoints' rows.json
                if uses_rollout_worker(cfg):
                    ahead = start_rollout_ahead(cfg, inputs, workers, stream, start_step, resume)
                plan = _plan(cfg, inputs, workers, start_step, changed or {}, run_dir)
                plan.ray, plan.placement = ray_target.describe(), workers.placement
                on_event(plan)
                monitor = AlarmMonitor(cfg.alarms)
                if start_step:  # a resumed run's alarms see the steps before the checkpoint too
                    for row in _rows_up_to(rdir.metrics_path, start_step):
                        monitor.observe(row)
                alarms: list[dict] = []
                stopped_by = None
                # what the summary needs of the steps, not the steps: a StepRecord (memory records,
                # shapes, timings) kept per step grew the driver ~11 KB a step (bench/soak.py)
                steps_run, rewards_first10, rewards_last10 = 0, [], deque(maxlen=10)
                val_before = val_after = None
                if cfg.trainer.val_freq and start_step == 0:
                    v = _validate_phase(cfg, inputs, workers, start_step, emit)
                    val_before = v.accuracy if v.accuracy is not None else v.reward
                    rdir.append_validation(v)
                    emit(v)
                checkpoints = []
                diverged: list[int] = []  # the latest steps in a row whose every policy update was skipped
                clock = StepClock(start_step, cfg.trainer.total_steps)  # step k/N, elapsed, ETA for the CLI
                on_event(clock.start())
                for step in range(start_step + 1, cfg.trainer.total_steps + 1):
                    workers.take_bytes()
                    with oom_guard("step", None, step):  # the driver's own allocations (engine/memory/oom.py)
                        rec = rl_step(cfg, inputs, workers, stream, step, ahead)
                    rec.driver_bytes = workers.take_bytes()
                    last = step == cfg.trainer.total_steps
                    if cfg.trainer.val_freq and (step % cfg.trainer.val_freq == 0 or last):
                        v = _validate_phase(cfg, inputs, workers, step, emit)
                        rec.val_accuracy, rec.val_reward = v.accuracy, v.reward
                        rdir.append_validation(v)
                        tracking.on_event(v)  # the CLI shows it in the step's row
                        val_after = v.accuracy if v.accuracy is not None else v.reward
                    rec.alarms = [a.to_json() for a in monitor.observe(rec.to_json())]
                    alarms += rec.alarms
                    if rec.alarms and cfg.trainer.stop_on_alarm:
                        stopped_by = rec.alarms[0]["kind"]
                    saving = bool(cfg.checkpoint.save_freq and step % cfg.checkpoint.save_freq == 0) or \
                        (last and cfg.checkpoint.save_final) or stopped_by is not None
                    if saving:
                        rec.checkpoint = str(rdir.path / step_dir_name(step))
                    # the step's rows go to disk before its checkpoint: a kill between the two can
                    # only leave rows that resume truncates, never a checkpoint without its rows
                    tracking.on_event(rec)  # metrics.jsonl, samples.jsonl, loggers
                    rdir.append_memory(rec.memory)
                    on_event(rec)
                    on_event(clock.tick(step))
                    if saving:
                        workers.onload(step)  # checkpoints read the live params and optimizer state
                        tmp, final = rdir.path / f"{TMP_PREFIX}{step}", rdir.path / step_dir_name(step)
                        with phase(emit, "save_checkpoint", f"save checkpoint {final}", step=step,
                                   poll=lambda: tree_bytes(tmp if tmp.exists() else final)):
                            rdir.save(cfg, workers, step, stream, ahead)
                        checkpoints.append(rec.checkpoint)
                    steps_run += 1
                    if len(rewards_first10) < 10:
                        rewards_first10.append(rec.reward_mean)
                    rewards_last10.append(rec.reward_mean)
                    if stopped_by is not None:
                        break
                    skipped = rec.algo.get("nonfinite_updates", 0)
                    diverged = diverged + [step] if skipped and skipped == rec.algo.get("updates") else []
                    if len(diverged) >= cfg.alarms.nonfinite_steps:
                        raise DivergedError(diverged, rec.grad_norm, rdir.path)
            except RewardError as e:  # the user's reward code failed: saved checkpoints stay as they are
                raise RewardError(e.failure, e.prompt, resume_hint=_last_checkpoint_hint(rdir.path)) from None
            except WorkerLost as e:  # an actor outside the ranks (the rollout worker) died: the same
                from engine.memory.oom import killed_for_memory

                killed = killed_for_memory(e.detail, workers.oom_kills_at_start)
                after = (f"It was {killed}. " if killed else "") + _last_checkpoint_hint(rdir.path, fix="")
                raise WorkerLost(e.what, e.detail, after=after) from None
            finally:
                inputs.rewards.close()
                if ahead is not None:
                    ahead.shutdown()
                workers.shutdown()
        failed = False
    except OutOfMemory as e:  # any phase, any rank or the driver: one paragraph with the estimate's top fix
        if e.phase == "save_checkpoint" and e.step is not None:  # the unfinished save is never a checkpoint
            shutil.rmtree(rdir.path / f"{TMP_PREFIX}{e.step}", ignore_errors=True)
        where = workers._where(e.rank) if e.rank is not None and workers is not None else ""
        raise answer(e, cfg, rdir.path, where) from None
    finally:
        if tracking is not None:
            tracking.close(failed=failed)
    summary = RunSummary(
        steps_run=steps_run, first_step=start_step + 1, last_step=start_step + steps_run,
        reward_first10=_mean(rewards_first10), reward_last10=_mean(list(rewards_last10)),
        wall_time_s=time.perf_counter() - t_start, run_dir=str(run_dir), metrics_path=str(rdir.metrics_path),
        checkpoints=checkpoints, val_before=val_before, val_after=val_after, tracking=tracking.stats(),
        alarms=alarms, stopped_by_alarm=stopped_by,
        placement=workers.placement, versions_ahead=versions_ahead(cfg))
    on_event(summary)
    return summary


def _load_step_modules() -> None:
    """torch and the step's algorithms (imported where used; loaded here once, ahead of time,
    without the collector's passes: engine/import_gc.py)."""
    from engine.import_gc import imports_without_gc

    with imports_without_gc():
        import torch  # noqa: F401

        import engine.algorithms.dynamic_sampling  # noqa: F401
        import engine.algorithms.estimators  # noqa: F401


def start_rollout_ahead(cfg: RunConfig, inputs: RunInputs, workers, stream: PromptStream, start_step: int, resume):
    """The rollout worker, loaded with the ranks' weights (version ``start_step``) and, on resume,
    the batches the checkpoint had queued and its sampling generator."""
    from engine.trainer.rollout_ahead import RolloutAhead

    episodes = None
    if inputs.agent is not None:  # multi-turn: the agent loop on the driver, each turn sampled on the worker
        n = cfg.algorithm.rollout_n
        episodes = lambda generate, prompts, idx: run_episodes(inputs, generate, prompts, n, idx)  # noqa: E731
    ahead = RolloutAhead(cfg, workers, stream, inputs.train_prompts, episodes)
    ahead.score_with(lambda d, step: score_rollout(cfg, inputs, stream.n, d.indices, d.samples_seen, d.batch, step))
    try:
        ahead.start(workers.model_path, inputs.vocab, start_step)
        if resume is not None:
            from engine.checkpoint.rollout_queue import load_rollout_queue

            ahead.load_state_dict(load_rollout_queue(Path(resume.step_dir)))
    except BaseException:
        ahead.shutdown()
        raise
    return ahead


def rl_step(cfg: RunConfig, inputs: RunInputs, workers, stream: PromptStream, step: int, ahead=None) -> StepRecord:
    timing = {}
    t0 = time.perf_counter()

    # 1-5. rollout and reward, advantages, the update (rollout_then_update: one after the other;
    # trainer.mode=streamed: the update starts on the first complete prompt groups)
    workers.onload(step)
    gen_stats: list = []
    scores: list = []
    if cfg.trainer.mode == "streamed":  # 1-5 at once: the ranks update on each chunk of groups as it completes
        from engine.trainer.streamed_update import streamed_step

        done = streamed_step(cfg, inputs, workers, stream, step, ahead, timing, gen_stats, scores)
    else:
        done = rollout_then_update(cfg, inputs, workers, stream, step, ahead, timing, gen_stats, scores)
    ro, sampling, est = done.rollout, done.sampling, done.estimate
    batch, rewards = ro.batch, ro.rewards
    correct = sum(ro.correct) / len(ro.correct) if ro.correct is not None else None
    ppo, update_policy, n_updates, routing, kl_reward = (done.ppo, done.update_policy, done.n_updates, done.routing,
                                                          done.kl_reward)
    totals: dict[str, float] = {}
    tokens = padded = 0
    shapes: set = set()
    peak = max(s["rss_peak"] for s in gen_stats)
    for res in done.results:
        add_metrics(totals, res.metrics)
        tokens += res.tokens
        padded += res.padded_tokens
        shapes.update(res.shapes)
        peak = max(peak, res.rss_peak)
    if ahead is not None:  # version `step` to the rollout worker, behind the rollouts queued above
        ahead.load_version(step)
        timing["weight_sync"] = ahead.sync_s

    # 6. offload between steps (as configured) and collect every rank's memory records
    t = time.perf_counter()
    offloaded = workers.offload()
    timing["offload"] = time.perf_counter() - t
    memory = [rec for o in offloaded for rec in o["memory"]]
    per_update = mean_over_updates(totals, n_updates)
    if kl_reward is not None:
        per_update["kl"] = kl_reward
    resp_tokens = float(batch.response_mask.sum())
    algo = {k: v for k, v in est.metrics.items() if k != "kl_reward"}
    algo.update({k: v for k, v in per_update.items() if k.startswith("value_") and k != "value_nonfinite_updates"})
    algo.update({k: v for k, v in per_update.items() if k.startswith("seq_")})  # GSPO's sequence ratio
    algo.update(rollout_ratio_metrics(per_update))  # the trainer's policy against the sampler's
    for key in ("nonfinite_updates", "value_nonfinite_updates"):  # updates skipped for a nan/inf gradient norm
        if totals.get(key):
            algo[key] = int(totals[key])
            algo["updates"] = n_updates
    if ppo:
        algo["policy_updated"] = update_policy
    if "rows_skipped" in totals:  # rows the update left out: zero advantage, no gradient (engine/backends/zero_advantage.py)
        algo["update_rows_skipped_frac"] = totals["rows_skipped"] / (cfg.algorithm.ppo_epochs * len(batch))
    algo.update(routing)
    if "agent" in batch.extras:  # multi-turn: turns, tool calls and errors, why trajectories ended
        algo.update({f"agent_{k}": v for k, v in batch.extras["agent"]["metrics"].items()})
    if sampling is not None:
        algo.update({f"dynamic_sampling_{k}": v for k, v in asdict(sampling).items()} | {"batch_rows": len(batch)})
    lengths = batch.response_mask.sum(-1)
    step_time = time.perf_counter() - t0
    adv_tokens = batch.advantages[batch.response_mask > 0]
    samples = []
    if is_sample_step(step, cfg.trainer.sample_log_freq):
        samples = sample_rows(cfg, inputs, ro, step)
    return StepRecord(
        step=step, reward_mean=float(rewards.mean()), accuracy=correct, kl=per_update.get("kl"),
        pg_loss=per_update.get("pg_loss", 0.0), entropy=per_update.get("entropy"),
        grad_norm=per_update.get("grad_norm", 0.0), lr=per_update.get("lr", 0.0),
        response_len_mean=resp_tokens / len(batch),
        rollout_tokens_per_s=resp_tokens / max(timing["rollout"], 1e-9),
        update_tokens_per_s=tokens / max(timing["update"], 1e-9),
        step_time_s=step_time, peak_mem_bytes=int(peak),
        pad_fraction=(padded - tokens) / padded if padded else 0.0, distinct_shapes=len(shapes),
        micro_batch_shapes=[list(s) for s in sorted(shapes)],
        timing=timing, memory=memory, algo=algo, reward_fns=_fn_means(scores) if len(scores[0].per_fn) > 1 else {},
        reward_failures=sum(len(sc.failures) for sc in scores),
        clip_frac=per_update.get("clip_frac"), rollout_kl=per_update.get("rollout_kl"),
        adv_mean=float(adv_tokens.mean()) if adv_tokens.numel() else 0.0,
        adv_std=float(adv_tokens.std()) if adv_tokens.numel() > 1 else 0.0,
        adv_min=float(adv_tokens.min()) if adv_tokens.numel() else 0.0,
        adv_max=float(adv_tokens.max()) if adv_tokens.numel() else 0.0,
        response_len_min=int(lengths.min()), response_len_max=int(lengths.max()),
        response_clip_frac=truncated_fraction(batch, cfg.rollout.max_new_tokens, inputs.vocab["ends"]),
        samples_per_s=len(batch) / max(step_time, 1e-9), mem_peaks=memory_peaks(memory), samples=samples,
        staleness=staleness_record(ro.versions, step) if ahead is not None else {})


@dataclass
class Updated:
    """Steps 1-5 of one RL step: the rollout trained on, its advantages, and the update's results."""

    rollout: Rollout                  # the batch (with advantages), its rewards, correctness, versions
    sampling: object                  # DynamicSamplingStats, or None
    estimate: object                  # engine.algorithms.estimators.Advantages of the batch
    results: list                     # UpdateResult per optimizer step (policy and critic)
    n_updates: int = 1
    ppo: bool = False
    update_policy: bool = True
    routing: dict = field(default_factory=dict)
    kl_reward: float | None = None


def rollout_then_update(cfg: RunConfig, inputs: RunInputs, workers, stream: PromptStream, step: int, ahead,
                        timing: dict, gen_stats: list, scores: list) -> Updated:
    """Steps 1-5 one after the other: the whole batch's rollout and rewards, reference log-probs,
    advantages, old log-probs, then ppo_epochs x mini-batches of updates."""
    n = cfg.algorithm.rollout_n
    draw = lambda k: rollout_and_reward(cfg, inputs, workers, stream, k, timing, gen_stats, scores, step,  # noqa: E731
                                        ahead)
    # 1-2. rollout (n samples per prompt, prompt-major) and reward; DAPO's dynamic sampling
    # rolls out further prompts until the batch holds train_batch_size informative groups
    sampling = None
    if cfg.algorithm.dynamic_sampling:
        from engine.algorithms.dynamic_sampling import dynamic_sample

        ro, sampling = dynamic_sample(draw, cfg.data.train_batch_size, n, cfg.algorithm.dynamic_sampling_max_rounds,
                                      inputs.vocab["pad"])
    else:
        ro = draw(cfg.data.train_batch_size)
    batch, rewards = ro.batch, ro.rewards
    if ahead is not None:  # each row's age, for the loss's clip against the weights that sampled it
        batch.versions_behind = versions_behind(ro.versions, step, batch.response_mask)
    if ahead is not None:  # the next steps' rollouts run on the rollout worker during this update
        ahead.queue_ahead(step)

    # 3. reference log-probs (KL), then advantages (the estimator algorithm.name names)
    t = time.perf_counter()
    kl_tok = None
    if cfg.algorithm.kl_coef > 0:
        from engine.algorithms.policy_loss import batch_kl

        batch.ref_log_probs = workers.log_probs(batch, ref=True)
        kl_tok = batch_kl(batch, cfg.algorithm.kl_type)
    ppo = cfg.algorithm.name == "ppo"
    if ppo:  # the critic's values before this step's update: GAE's baseline and value clipping's anchor
        batch.values = workers.values(batch)
    timing["log_probs"] = time.perf_counter() - t
    from engine.algorithms.estimators import compute_advantages

    est = compute_advantages(cfg.algorithm, rewards, batch.response_mask, n, kl=kl_tok, values=batch.values,
                             max_len=cfg.rollout.max_new_tokens)
    batch.advantages, batch.returns = est.advantages, est.returns
    kl_reward = est.metrics.get("kl_reward") if kl_tok is not None and not cfg.algorithm.use_kl_loss else None

    # 4. old log-probs
    t = time.perf_counter()
    mini, n_updates = mini_batch_prompts(cfg), updates_per_step(cfg)
    if n_updates > 1:  # with one update per step, old == current policy exactly
        batch.old_log_probs = workers.log_probs(batch, ref=False)
    routing = {}
    if cfg.algorithm.router_replay != "off":  # MoE: rollout-vs-trainer routing and log-prob gap
        from engine.moe.routing_metrics import RoutingSums, summarize

        routing = summarize(RoutingSums(**workers.routing_report(batch)))
    timing["log_probs"] += time.perf_counter() - t

    # 5. policy update: ppo_epochs x mini-batches (whole prompt groups), one optimizer step each;
    # PPO: a critic step on each mini-batch too, and only the critic during critic.warmup_steps
    update_policy = not ppo or step > cfg.critic.warmup_steps
    t = time.perf_counter()
    results = []
    rows_per_mini = mini * n
    for _epoch in range(cfg.algorithm.ppo_epochs):
        for start in range(0, len(batch), rows_per_mini):
            mb = batch.select(slice(start, start + rows_per_mini))
            results += ([workers.critic_train_step(mb)] if ppo else []) + \
                ([workers.train_step(mb)] if update_policy else [])
    timing["update"] = time.perf_counter() - t
    return Updated(ro, sampling, est, results, n_updates, ppo, update_policy, routing, kl_reward)


def rollout_and_reward(cfg: RunConfig, inputs: RunInputs, workers, stream: PromptStream, k: int,
                       timing: dict, gen_stats: list, scores: list, step: int = 1, ahead=None) -> Rollout:
    """The next ``k`` prompts, each sampled algorithm.rollout_n times, scored by the task's
    functions (engine/rewards: serially or in a process pool; with each response's token ids and
    where training is, for functions that ask); adds to ``timing`` (rollout, reward),
    ``gen_stats`` (per rank) and ``scores`` (engine.rewards.compute.RewardScores per draw).
    A batch the rollout worker sampled ahead was usually scored while the ranks updated
    (rollout_ahead.py): ``reward`` is then what the step still waited for, ``reward_ahead`` the
    scoring's own time."""
    from engine.algorithms.dynamic_sampling import Rollout

    t = time.perf_counter()
    n = cfg.algorithm.rollout_n
    pre = None
    if ahead is None:  # the ranks sample with the weights they train (sync)
        idx = stream.next_indices(k)
        seen, version = stream.pos.samples_seen, step - 1
    if ahead is None and cfg.trainer.stream_groups:  # each prompt group scored as it ends
        batch, stats, pre, waited = streamed_rollout(cfg, inputs, workers, stream.n, idx, seen, step)
        gen_stats += stats
        timing["rollout"] = timing.get("rollout", 0.0) + time.perf_counter() - t - waited
        timing["reward"] = timing.get("reward", 0.0) + waited  # what scoring still took after the last group
        timing["reward_ahead"] = timing.get("reward_ahead", 0.0) + pre.seconds
        scores.append(pre.scored)
        return Rollout(batch, pre.rewards, pre.scored.correct, pre.examples, versions=[version] * len(batch))
    if ahead is None:
        batch, stats = generate_turns(inputs, workers, [inputs.train_prompts[i] for i in idx], n, idx=idx)
    else:  # the rollout worker's batch, queued earlier or sampled now (engine/trainer/rollout_ahead.py)
        # the next batches are asked first, unless dynamic sampling may still ask for more rounds now
        idx, seen, batch, one, pre = ahead.take(k, step, queue_next=not cfg.algorithm.dynamic_sampling)
        version, stats = one["version"], [one]
        # what the step waited for it; "rollout" stays the sampling's own time (tokens/s)
        timing["rollout_wait"] = timing.get("rollout_wait", 0.0) + time.perf_counter() - t - ahead.score_wait_s
        timing["reward"] = timing.get("reward", 0.0) + ahead.score_wait_s  # its scoring, not yet done
        t = time.perf_counter() - one["time"]
    gen_stats += stats
    timing["rollout"] = timing.get("rollout", 0.0) + time.perf_counter() - t

    t = time.perf_counter()
    if pre is not None:
        timing["reward_ahead"] = timing.get("reward_ahead", 0.0) + pre.seconds
    else:
        pre = score_rollout(cfg, inputs, stream.n, idx, seen, batch, step)
    scores.append(pre.scored)
    timing["reward"] = timing.get("reward", 0.0) + time.perf_counter() - t
    return Rollout(batch, pre.rewards, pre.scored.correct, pre.examples, versions=[version] * len(batch))


@dataclass
class ScoredRollout:
    """One batch's rewards: the task's scores (plus an environment's own), and what scoring took."""

    scored: object            # engine.rewards.compute.RewardScores
    rewards: object           # [B] float32 tensor
    examples: list
    seconds: float


def score_rollout(cfg: RunConfig, inputs: RunInputs, prompts: int, idx: list[int], seen: int, batch,
                  step: int) -> ScoredRollout:
    """The rewards of ``batch`` (the prompts ``idx``, drawn when ``seen`` samples had been) for
    ``step``: reward functions that ask see the trainer state before ``step``'s update."""
    import torch

    t = time.perf_counter()
    examples = [inputs.task.train[i] for i in idx]
    responses, ids = decode_responses(inputs.tokenizer, batch), response_token_ids(batch)
    agent = batch.extras.get("agent")
    if agent is not None:  # multi-turn: the task scores the model's last turn
        responses = agent["responses"]
    state = reward_state(cfg, prompts, seen, completed_steps=step - 1)
    with oom_guard("reward", None, step):
        scored = inputs.rewards.score(samples_of(examples, responses, cfg.algorithm.rollout_n, ids), state)
    rewards = torch.tensor(scored.total, dtype=torch.float32)
    if agent is not None:  # an environment's own rewards join the task's
        rewards += torch.tensor([r or 0.0 for r in agent["env_rewards"]], dtype=torch.float32)
    return ScoredRollout(scored, rewards, examples, time.perf_counter() - t)


def streamed_rollout(cfg: RunConfig, inputs: RunInputs, workers, prompts: int, idx: list[int], seen: int,
                     step: int):
    """trainer.stream_groups: the ranks sample ``idx``'s prompts and hand over each prompt group as
    it ends; each is scored (score_rollout, on a driver thread) as soon as it arrives, while the
    rest decode. Returns the batch (the groups in prompt order: ``generate``'s batch), the ranks'
    stats, the whole batch's ScoredRollout and the seconds scoring still took after the last group."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from engine.batch import SequenceBatch
    from engine.rewards.compute import RewardScores

    n = cfg.algorithm.rollout_n
    stats: list = []
    parts: list = []  # (position of the group's prompt, its rows, its scoring)
    with ThreadPoolExecutor(1, thread_name_prefix="rl-score-stream") as pool:
        for pos, rows in workers.generate_stream([inputs.train_prompts[i] for i in idx], n, stats):
            sub = idx[pos:pos + len(rows) // n]
            parts.append((pos, rows, pool.submit(score_rollout, cfg, inputs, prompts, sub, seen, rows, step)))
        t = time.perf_counter()
        parts.sort(key=lambda p: p[0])
        scored = [p[2].result() for p in parts]  # a reward function's error surfaces here
        waited = time.perf_counter() - t
    batch = SequenceBatch.concat([p[1] for p in parts], inputs.vocab["pad"]) if len(parts) > 1 else parts[0][1]
    whole = ScoredRollout(RewardScores.concat([s.scored for s in scored]), torch.cat([s.rewards for s in scored]),
                          [e for s in scored for e in s.examples], sum(s.seconds for s in scored))
    return batch, stats, whole, waited


def generate_turns(inputs: RunInputs, workers, prompts: list[list[int]], n: int, greedy: bool = False, idx=None):
    """``workers.generate``, or with tools/an environment the multi-turn loop over it
    (engine/agents/loop.py); the batch's ``extras["agent"]`` then holds the conversations,
    the last turns (what the reward scores), the environment's rewards and the loop's metrics."""
    if inputs.agent is None:
        return workers.generate(prompts, n, greedy=greedy)
    stats: list = []

    def gen(p, k):  # a vLLM engine stays awake from turn to turn (a sleep moves its weights to the host)
        b, s = workers.generate(p, k, greedy=greedy, keep_awake=True)
        stats.append(s)
        return b

    batch = run_episodes(inputs, gen, prompts, n, idx)
    workers.sleep_samplers()  # before the phases that need the memory (a failed loop ends the run)
    return batch, _merge_gen_stats(stats)


def run_episodes(inputs: RunInputs, generate, prompts: list[list[int]], n: int, idx=None) -> SequenceBatch:
    """The multi-turn loop (engine/agents/loop.py) over ``generate(prompts, n)`` -- the ranks', or
    the rollout worker's (trainer.mode=one_step_off|async) -- for the training prompts ``idx`` (None:
    the held-out set); ``extras["agent"]`` holds the conversations, the last turns (what the reward
    scores), the environment's rewards and the loop's metrics."""
    examples = inputs.task.val if idx is None else [inputs.task.train[i] for i in idx]
    out = inputs.agent.run(generate, prompts, examples, n, inputs.tokenizer)
    out.batch.extras["agent"] = {"responses": out.responses(), "env_rewards": out.env_rewards(),
                                 "metrics": out.metrics(),
                                 "conversations": [t.messages for t in out.trajectories]}
    return out.batch


def _merge_gen_stats(calls: list[list[dict]]) -> list[dict]:
    """One record per rank over the loop's several generate calls (each a list, one per rank):
    times added, peaks kept."""
    merged = [dict(s) for s in calls[0]]
    for call in calls[1:]:
        for acc, s in zip(merged, call):
            for k, v in s.items():
                if isinstance(v, (int, float)) and isinstance(acc.get(k), (int, float)):
                    acc[k] = acc[k] + v if k == "time" else max(acc[k], v)
    return merged


def truncated_fraction(batch: SequenceBatch, max_new_tokens: int, ends: list[int]) -> float:
    """Fraction of responses cut at max_new_tokens: a last model turn that long (the response,
    single-turn; each turn is sampled under the limit on its own), not ending with one of the
    model's end tokens ``ends``."""
    import torch

    from engine.algorithms.estimators import turn_runs

    mask = batch.response_mask
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = (positions * (mask > 0)).argmax(-1, keepdim=True)
    lengths = turn_runs(mask).gather(1, last).squeeze(1)
    last_token = batch.input_ids.gather(1, last).squeeze(1)
    cut = (lengths >= max_new_tokens) & ~torch.isin(last_token, torch.tensor(list(ends)))
    return float(cut.float().mean()) if len(lengths) else 0.0


def memory_peaks(records: list) -> dict:
    """Largest bytes per category (and process RSS / device peaks) over every rank and phase."""
    out: dict[str, int] = {}
    for r in records:
        for k, v in (r.get("categories") or {}).items():
            if v:
                out[f"{k}_bytes"] = max(out.get(f"{k}_bytes", 0), int(v))
        for k in ("peak_rss", "peak_allocated", "peak_reserved"):
            if r.get(k):
                out[f"{k}_bytes"] = max(out.get(f"{k}_bytes", 0), int(r[k]))
    return out


def last_logged_step(run_dir: Path) -> int:
    """Highest step metrics.jsonl holds (-1 if none): what a previous segment already logged."""
    p = Path(run_dir) / "metrics.jsonl"
    last = -1
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                last = max(last, int(json_safe.loads(line).get("step", -1)))
            except (ValueError, AttributeError):
                continue
    return last


def _validate_phase(cfg: RunConfig, inputs: RunInputs, workers, step: int, emit) -> Validation:
    with phase(emit, "validation", f"validation at step {step} ({len(inputs.val_prompts)} held-out prompts)",
               step=step):
        return validate(cfg, inputs, workers, step)


def _load_label(cfg: RunConfig, inputs: RunInputs) -> str:
    n = cfg.trainer.nprocs
    what = f"load {inputs.model_path}" if inputs.model_path else f"build the {cfg.model.preset} model"
    if cfg.engine.name == "megatron" and inputs.model_path:
        what += " (convert to megatron)"
    if cfg.rollout.name == "vllm":
        what += ", start vLLM"
    return f"start {n} rank{'s' if n > 1 else ''}: {what}"


def _model_bytes(model_path: str) -> int | None:
    if not model_path or not Path(model_path).is_dir():
        return None
    return sum(p.stat().st_size for p in Path(model_path).iterdir()
               if p.suffix in (".safetensors", ".bin", ".gguf") and p.is_file()) or None

def sample_rows(cfg: RunConfig, inputs: RunInputs, ro, step: int) -> list[dict]:
    """trainer.sample_log_n prompt/response/reward rows of this step (only those rows are decoded)."""
    n = cfg.algorithm.rollout_n
    batch = ro.batch
    mask = batch.response_mask
    seq_adv = ((batch.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
    rows = pick_rows(step, cfg.trainer.sample_log_n, [e.prompt for e in ro.examples], list(range(len(batch))),
                     ro.rewards.tolist(), seq_adv, [e.answer for e in ro.examples], n)
    picked = [r["response"] for r in rows]
    texts = decode_responses(inputs.tokenizer, batch.select(picked))
    agent = batch.extras.get("agent")
    for r, i, text in zip(rows, picked, texts):
        r["response"] = text
        if agent is not None:  # the whole conversation after the prompt
            r["response"] = agent["responses"][i]
            r["conversation"] = agent["conversations"][i]
    return rows


def validate(cfg: RunConfig, inputs: RunInputs, workers, step: int) -> Validation:
    """Greedy generation on the held-out split: accuracy (if the task defines it) and reward."""
    if not inputs.val_prompts:
        return Validation(step, None, 0.0)
    workers.onload(step)
    batch, _ = generate_turns(inputs, workers, inputs.val_prompts, 1, greedy=True)
    responses = decode_responses(inputs.tokenizer, batch)
    if "agent" in batch.extras:  # multi-turn: the model's last turn is the answer
        responses = batch.extras["agent"]["responses"]
    state = replace(reward_state(cfg, len(inputs.train_prompts), 0, completed_steps=step),  # after step's update
                    epoch=inputs.rewards.state.epoch)
    scored = inputs.rewards.score(samples_of(inputs.task.val, responses, 1, response_token_ids(batch)), state)
    reward = sum(scored.total) / len(responses)
    acc = None if scored.correct is None else sum(scored.correct) / len(responses)
    return Validation(step, acc, reward, scored.correct, rewards=scored.total, reward_failures=len(scored.failures),
                      responses=responses)


def response_token_ids(batch: SequenceBatch) -> list[list[int]]:
    """Each response's token ids, as sampled (TRL's ``completion_ids``)."""
    return [batch.input_ids[i][batch.response_mask[i] > 0].tolist() for i in range(len(batch))]


def decode_responses(tokenizer, batch: SequenceBatch) -> list[str]:
    return [tokenizer.decode(ids) for ids in response_token_ids(batch)]


def reward_state(cfg: RunConfig, prompts: int, drawn: int, completed_steps: int):
    """Where training is, for reward functions that ask for ``trainer_state`` (TRL's fields):
    ``drawn`` of the ``prompts`` training prompts drawn so far."""
    from engine.rewards.trainer_state import TrainerState

    total = cfg.trainer.total_steps
    return TrainerState(global_step=completed_steps, max_steps=total, epoch=drawn / prompts,
                        num_train_epochs=total * cfg.data.train_batch_size / prompts)


def _fn_means(scores: list) -> dict:
    """Each reward function's mean over every sample drawn this step (all dynamic-sampling rounds)."""
    # a function's Nones ("does not apply", TRL) are left out of its mean; one that gave none is not logged
    given = {name: [v for sc in scores for v in sc.per_sample_fn[name] if v is not None] for name in scores[0].per_fn}
    return {name: sum(v) / len(v) for name, v in given.items() if v}


def _last_checkpoint_hint(run_dir: Path, fix: str = "fix the function and ") -> str:
    from engine.checkpoint.layout import latest_complete

    latest = latest_complete(run_dir)
    if latest is None:
        return (f"No checkpoint was saved yet: {fix}start again (`checkpoint.overwrite=true` "
                f"replaces {run_dir}).")
    return f"The last checkpoint, {latest.path}, is intact: {fix}continue with `rl resume {run_dir}`."


class DivergedError(UserError):
    """Every policy update of ``alarms.nonfinite_steps`` steps in a row had a nan/inf gradient."""

    def __init__(self, steps: list[int], grad_norm: float, run_dir: Path):
        span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
        super().__init__(
            f"Training diverged: every policy update of {span} had a non-finite gradient norm ({grad_norm}), so each "
            f"was skipped and the run is going nowhere. Checkpoints from step {steps[0]} on hold the weights of step "
            f"{steps[0] - 1} (no later update was applied), which may be what diverges; optim.* cannot change on "
            f"resume, so start a new run with a lower optim.lr or optim.grad_clip > 0, check the reward for "
            f"outliers, or train in model.dtype=float32 (`checkpoint.overwrite=true` replaces {run_dir}; "
            f"alarms.nonfinite_steps sets how many such steps stop a run).", title="training diverged")


def _rows_up_to(path: Path, step: int) -> list[dict]:
    if not path.exists():
        return []
    rows = [json_safe.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) <= step]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _data_line(inputs: RunInputs) -> str:
    """Where prompts came from, for the plan table (dataset tasks): source, format, dropped rows."""
    info = inputs.task.data_info
    dropped = sum((info.get("dropped_overlong") or {}).values())
    parts = [f"{info['source']}  (format {info['format']}"] if info.get("source") else []
    if parts and info.get("val_split"):
        parts[0] += f", held-out split {info['val_split']}"
    if parts:
        parts[0] += ")"
    if dropped:
        parts.append(f"{dropped} overlong prompts dropped")
    return "; ".join(parts)


def _plan(cfg: RunConfig, inputs: RunInputs, workers, start_step: int, changed: dict, run_dir: Path) -> RunPlan:
    c = cfg
    key = {"data.train_batch_size": c.data.train_batch_size, "algorithm.rollout_n": c.algorithm.rollout_n,
           "optim.lr": c.optim.lr, "algorithm.kl_coef": c.algorithm.kl_coef,
           "algorithm.loss_agg_mode": c.algorithm.loss_agg_mode, "rollout.temperature": c.rollout.temperature,
           "rollout.max_new_tokens": c.rollout.max_new_tokens, "engine.pad_to_length": c.engine.pad_to_length}
    if workers.info[0].get("micro_batch_budget"):  # engine.max_tokens_per_micro_batch=0, fitted by the ranks
        key["engine.max_tokens_per_micro_batch"] = workers.info[0]["micro_batch_budget"]
    if c.trainer.mode != "sync":
        key["trainer.mode"] = c.trainer.mode + (f" (max_staleness={c.trainer.max_staleness})"
                                                if c.trainer.mode == "async" else "")
    return RunPlan(engine=c.engine.name, model=c.model.path or c.model.preset, num_params=workers.info[0]["params"],
                   ranks=c.trainer.nprocs, dp_size=workers.dp_size, device=workers.info[0]["device"],
                   task=c.task.name, num_train=len(inputs.train_prompts), num_val=len(inputs.val_prompts),
                   total_steps=c.trainer.total_steps, start_step=start_step, rollout=c.rollout.name,
                   key_settings=key, changed=changed, run_dir=str(run_dir), data=_data_line(inputs),
                   reward=inputs.rewards.describe(),
                   changed_from="checkpoint" if start_step else "default")
