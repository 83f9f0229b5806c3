"""The one entry point the trainer uses: ``RewardRunner.score(samples) -> RewardScores``.

Each reward function is called on every sample (per sample, or on batches), wherever the
config says (driver, watched thread, process pool). The total is the weighted sum of the
functions' scores; each function's mean is reported on its own. Correctness comes from
``task.correct_fn`` or from the first reward function that returns ``(score, correct)``.

A function's ``None`` for a sample means "does not apply" (TRL): that sample is left out of the
function's mean and adds 0 to the sum (TRL's nansum); when every function returned None for a
sample, it is listed in ``RewardScores.unscored`` and a warning names the first such row (as TRL
warns). Functions that ask for ``trainer_state`` get ``score(..., state=)`` (the last one given
stays until another is).

A call that raises, returns something that is not a score, or takes longer than
``task.reward_timeout_s``: with ``task.reward_on_error=raise`` a ``RewardError`` naming the
function, the row and the exception; with ``zero`` the call scores 0 and is counted.

Batch scorers (engine/rewards/scorers.py: a reward model, a remote HTTP scorer) add their
weighted scores to the same sum, are logged under their own names (``reward_model``,
``reward_url``) and fail the same way: a batch one cannot score stops the run or scores 0.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Optional

from engine.errors import UserError
from engine.rewards.call import Sample
from engine.rewards.executors import ProcessPool, run_inline, run_watched
from engine.rewards.main_thread import off_main_thread_fix
from engine.rewards.scorers import BatchScorer, ScorerFailed
from engine.rewards.spec import RewardFnSpec
from engine.rewards.trainer_state import TrainerState


@dataclass
class RewardFailure:
    fn: str
    origin: str          # the row (or rows, for a batched call)
    error: str           # "ExcType: message", "bad return value: ...", or "timed out after N s"
    where: str = ""      # file:line in function, when known
    scorer: bool = False  # a batch scorer (reward model, remote scorer), not a function
    fix: str = ""         # what to do, when rl knows better than "fix the function"


class RewardError(UserError):
    """A reward function failed and ``task.reward_on_error=raise``."""

    def __init__(self, failure: RewardFailure, prompt: object = None, resume_hint: str = ""):
        self.failure, self.prompt = failure, prompt
        where = f" (at {failure.where})" if failure.where else ""
        shown = "" if prompt is None else f" (prompt {_short(prompt)})"
        if failure.scorer:
            super().__init__(
                f"`{failure.fn}` could not score {failure.origin}{shown}: {failure.error}. Fix the scorer, or set "
                f"task.reward_on_error=zero to score what it cannot score 0 and count it."
                f"{' ' + resume_hint if resume_hint else ''}", title="reward scorer failed")
            return
        super().__init__(
            f"reward function `{failure.fn}` failed on {failure.origin}{shown}: {failure.error}{where}. "
            f"{failure.fix or 'Fix the function (call it on that row to reproduce)'}, or set task.reward_on_error=zero "
            f"to score failing calls 0 and count them.{' ' + resume_hint if resume_hint else ''}",
            title="reward function failed")


@dataclass
class RewardScores:
    total: list[float]                       # weighted sum per sample
    per_fn: dict[str, float]                 # each reward function's mean raw score
    correct: Optional[list[bool]]            # per sample, when the task defines correctness
    failures: list[RewardFailure] = field(default_factory=list)
    per_sample_fn: dict[str, list] = field(default_factory=dict)  # None where a function returned None
    unscored: list[int] = field(default_factory=list)  # samples for which every reward function returned None

    @staticmethod
    def concat(parts: list["RewardScores"]) -> "RewardScores":
        """The scores of consecutive sample sets as one (trainer.stream_groups scores a rollout chunk by
        chunk): per-sample lists joined, indices shifted, each function's mean taken over all samples."""
        if len(parts) == 1:
            return parts[0]
        names = list(parts[0].per_sample_fn)
        raw = {name: [v for p in parts for v in p.per_sample_fn[name]] for name in names}
        offsets = [sum(len(q.total) for q in parts[:i]) for i in range(len(parts))]
        correct = None if any(p.correct is None for p in parts) else [c for p in parts for c in p.correct]
        return RewardScores([t for p in parts for t in p.total], {name: _mean(raw[name]) for name in names}, correct,
                            [f for p in parts for f in p.failures], raw,
                            [o + i for o, p in zip(offsets, parts) for i in p.unscored])


def _short(prompt: object, n: int = 80) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    s = repr(prompt)
    return s if len(s) <= n else s[:n - 3] + "...'"


class RewardRunner:
    def __init__(self, specs: list[RewardFnSpec], *, workers: int = 0, timeout_s: float = 0.0,
                 on_error: str = "raise", scorers: tuple = ()):
        self.scorers: list[BatchScorer] = list(scorers)
        self.specs = [s for s in specs if s.role == "reward"]
        self.correct_spec = next((s for s in specs if s.role == "correct"), None)
        self.workers, self.timeout_s, self.on_error = workers, timeout_s, on_error
        self._pool = ProcessPool(workers) if workers > 0 else None
        self.state = TrainerState()  # what a function asking for trainer_state gets (the last score()'s)
        self._warned_unscored = False
        # one caller at a time: a batch sampled ahead is scored on a driver thread (trainer/rollout_ahead.py)
        # while the main thread may score the held-out set
        self._busy = threading.Lock()

    def describe(self) -> str:
        parts = [s.name if len(self.specs) == 1 and s.weight == 1.0 else f"{s.weight:g} x {s.name}"
                 for s in self.specs]
        how = ["batched"] if any(s.batched for s in self.specs) else []
        how.append(f"{self.workers} workers" if self.workers else "serial")
        if self.timeout_s:
            how.append(f"timeout {self.timeout_s:g} s")
        if self.on_error == "zero":
            how.append("failures score 0")
        text = " + ".join(parts) + f"  ({', '.join(how)})" if parts else ""
        return " + ".join([text] * bool(text) + [sc.describe() for sc in self.scorers])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        for sc in self.scorers:
            sc.close()

    def _run_scorers(self, samples: list[Sample], stop: bool, failures: list) -> dict[str, list[float]]:
        """Each batch scorer's scores (0 where it failed and the policy is zero)."""
        out = {}
        for sc in self.scorers:
            try:
                out[sc.name] = sc.score(samples) if samples else []
            except ScorerFailed as e:
                rows = e.rows or list(range(len(samples)))
                origin = samples[rows[0]].origin if len(rows) == 1 else \
                    f"{len(rows)} samples ({samples[rows[0]].origin} .. {samples[rows[-1]].origin})"
                failure = RewardFailure(sc.name, origin, str(e), scorer=True)
                if stop:
                    raise RewardError(failure, samples[rows[0]].prompt if len(rows) == 1 else None) from None
                failures.append(failure)
                out[sc.name] = [e.partial.get(i, 0.0) for i in range(len(samples))]  # the rows it scored
        return out

    def _calls(self, spec: RewardFnSpec, samples: list[Sample], state) -> list[tuple[list[int], tuple]]:
        idx = list(range(len(samples)))
        if not spec.batched:
            groups = [[i] for i in idx]
        else:  # one batch per worker (contiguous), or the whole batch
            k = max(1, min(self.workers, len(samples)))
            size = -(-len(samples) // k)
            groups = [idx[a:a + size] for a in range(0, len(samples), size)]
        return [(g, (spec.target, spec.batched, spec.role, [samples[i] for i in g], state)) for g in groups]

    def _execute(self, calls: list[tuple], stop: bool, fn=None) -> list:
        kw = {} if fn is None else {"fn": fn}
        if self._pool is not None:
            return self._pool.run(calls, self.timeout_s, stop, **kw)
        if self.timeout_s:
            return run_watched(calls, self.timeout_s, stop, **kw)
        return run_inline(calls, stop, **kw)

    def execute(self, fn, calls: list[tuple]) -> list:
        """``fn(*call)`` for each call where reward functions run (the process pool, or the driver
        watched with the timeout), none stopping the others; one outcome per call (executors.py).
        The agent loop's tool calls run here (engine/agents/tool_calls.py)."""
        with self._busy:
            return self._execute(calls, False, fn)

    def score(self, samples: list[Sample], state: Optional[TrainerState] = None) -> RewardScores:
        with self._busy:
            return self._score(samples, state)

    def _score(self, samples: list[Sample], state: Optional[TrainerState]) -> RewardScores:
        if state is not None:
            self.state = state
        specs = self.specs + ([self.correct_spec] if self.correct_spec else [])
        plan = [(spec, groups) for spec in specs for groups in self._calls(spec, samples, self.state)]
        stop = self.on_error == "raise"
        outcomes = self._execute([c for _, (_, c) in plan], stop)
        n = len(samples)
        raw = {s.name: [0.0] * n for s in specs}
        returned_correct: dict[str, list] = {s.name: [None] * n for s in specs}
        failures: list[RewardFailure] = []
        for (spec, (group, _)), outcome in zip(plan, outcomes):
            if outcome is not None and outcome[0] == "ok":
                for i, (score, corr) in zip(group, outcome[1]):
                    raw[spec.name][i] = score
                    returned_correct[spec.name][i] = corr
                continue
            if outcome is None:
                continue  # not run: an earlier call failed and the run stops
            origin = samples[group[0]].origin if len(group) == 1 else \
                f"{len(group)} rows of one batched call ({samples[group[0]].origin} .. {samples[group[-1]].origin})"
            if outcome[0] == "timeout":
                failure = RewardFailure(spec.name, origin, f"no result within task.reward_timeout_s="
                                                            f"{self.timeout_s:g} s (hung, or too slow)")
            else:
                fix = "" if self._pool is not None else off_main_thread_fix(outcome[1], bool(self.timeout_s))
                failure = RewardFailure(spec.name, origin, outcome[1], outcome[2], fix=fix)
            if stop:
                raise RewardError(failure, samples[group[0]].prompt if len(group) == 1 else None)
            failures.append(failure)  # scored 0, counted
        scored = self._run_scorers(samples, stop, failures)
        total = [sum(s.weight * raw[s.name][i] for s in self.specs if raw[s.name][i] is not None) +
                 sum(sc.weight * scored[sc.name][i] for sc in self.scorers) for i in range(n)]
        unscored = [i for i in range(n) if self.specs and not self.scorers
                    and all(raw[s.name][i] is None for s in self.specs)]
        if unscored and not self._warned_unscored:
            self._warned_unscored = True  # once a run, as a step's rows would repeat it
            first = samples[unscored[0]]
            warnings.warn(f"every reward function returned None for {len(unscored)} of {n} samples, e.g. "
                          f"{first.origin} (prompt {_short(first.prompt)}); they score 0. Make sure at least one "
                          f"function returns a score for every sample.", stacklevel=2)
        correct = None
        if self.correct_spec is not None:
            correct = [bool(c) for c in returned_correct[self.correct_spec.name]]
        else:
            for s in self.specs:
                if any(c is not None for c in returned_correct[s.name]):
                    correct = [bool(c) for c in returned_correct[s.name]]
                    break
        raw.update(scored)
        names = [s.name for s in self.specs] + [sc.name for sc in self.scorers]
        per_fn = {name: _mean(raw[name]) for name in names}
        return RewardScores(total, per_fn, correct, failures, {name: raw[name] for name in names}, unscored)


def _mean(values: list) -> Optional[float]:
    """The mean of the scores a function gave (its Nones left out, TRL's nanmean); None if none."""
    given = [v for v in values if v is not None]
    return sum(given) / len(given) if given else None


def make_runner(task, task_cfg, scorers: tuple = ()) -> RewardRunner:
    """The runner for a task: its configured functions (dataset tasks), or the built-in task's
    own reward and correctness functions; parallelism and error policy from ``task.*``; the
    batch ``scorers`` (a reward model, a remote scorer) added to the sum."""
    from engine.rewards.spec import spec_for

    specs = list(task.reward_specs)
    if not specs and task.reward is not None:
        specs = [spec_for(task.reward)] + ([spec_for(task.correct, "correct")] if task.correct else [])
    return RewardRunner(specs, workers=task_cfg.reward_workers, timeout_s=task_cfg.reward_timeout_s,
                        on_error=task_cfg.reward_on_error, scorers=scorers)


def samples_of(examples: list, responses: list[str], n: int = 1,
               completion_ids: Optional[list] = None) -> list[Sample]:
    """Responses (prompt-major, ``n`` per example) -> reward samples; ``completion_ids``: each
    response's token ids as sampled (TRL's ``completion_ids``)."""
    ids = completion_ids if completion_ids is not None else [None] * len(responses)
    return [Sample(ex.prompt, r, ex.answer, ex.row, ex.origin, c) for ex, r, c in
            ((examples[i // n], r, c) for i, (r, c) in enumerate(zip(responses, ids)))]
