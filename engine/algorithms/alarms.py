"""Alarms for a run that is going wrong, computed from the step records alone.

``AlarmMonitor.observe(row)`` takes one step's metrics (a StepRecord's ``to_json()`` dict,
or a metrics.jsonl row) and returns the alarms that *start* at that step; an alarm that
stays true is not repeated until its condition has cleared once. The kinds:

- ``entropy_collapse``: policy entropy below ``entropy_min`` for ``entropy_steps`` steps in a
  row while the reward is still below ``entropy_reward_max`` (a policy that solved the task
  may be near-deterministic; one that stopped exploring below that reward is stuck).
- ``length_blowup``: the share of responses cut at rollout.max_new_tokens (no EOS) is at
  least ``truncated_max``, has risen by ``truncated_rise`` over its lowest value so far, and
  the mean reward of the last ``window`` steps is ``reward_drop`` below its best (longer
  responses that earn more reward are learning, not blowing up).
- ``logprob_mismatch``: approx KL between the rollout's token log-probs and the trainer's
  for the same weights above ``rollout_kl_max`` (sampler/trainer numerics disagree); judged
  only on steps whose samples came from the weights being trained (not stale ones).
- ``val_drop``: held-out score at least ``val_drop`` below its best while the mean training
  reward of the last ``window`` steps is above what it was when that best was measured.
- ``no_signal``: every token's advantage exactly 0 for ``no_signal_steps`` steps in a row: each
  prompt group's samples scored the same, so the reward moves nothing (a reward function that
  returns one value for everything, a task too hard or already learnt). Not judged where the
  advantages are not group-relative and never exactly 0 (PPO's GAE, a KL penalty in the reward).
- ``nonfinite_grad``: an optimizer step (policy or critic) had a nan/inf gradient norm and was
  skipped (the engines never apply one); ``nonfinite_steps`` such steps in a row with every
  policy update skipped stop the run (engine/trainer/trainer.py), whatever stop_on_alarm says.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Alarm:
    kind: str
    step: int
    message: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class AlarmMonitor:
    cfg: object                      # engine.config.schema.AlarmsConfig
    low_entropy_run: int = 0
    no_signal_run: int = 0
    truncated_min: float | None = None
    best_val: float | None = None
    reward_at_best_val: float | None = None
    best_recent: float | None = None
    rewards: list = field(default_factory=list)
    active: set = field(default_factory=set)

    def observe(self, row: dict) -> list[Alarm]:
        c = self.cfg
        step = int(row["step"])
        self.rewards.append(float(row["reward_mean"]))
        del self.rewards[:-c.window]  # only the window is read: a long run's list no longer grows
        recent = sum(self.rewards[-c.window:]) / len(self.rewards[-c.window:])
        self.best_recent = recent if self.best_recent is None else max(self.best_recent, recent)
        firing: dict[str, str] = {}

        ent = row.get("entropy")
        if ent is not None and ent < c.entropy_min and recent < c.entropy_reward_max:
            self.low_entropy_run += 1
        else:
            self.low_entropy_run = 0
        if self.low_entropy_run >= c.entropy_steps:
            firing["entropy_collapse"] = (
                f"policy entropy {ent:.4f} has been below {c.entropy_min} for {self.low_entropy_run} steps while "
                f"the reward ({recent:.3f}) is below {c.entropy_reward_max}: the policy stopped exploring. Try "
                f"algorithm.entropy_coef>0, a higher rollout.temperature, or algorithm=dapo (clip-higher).")

        lo, hi = row.get("adv_min"), row.get("adv_max")
        self.no_signal_run = self.no_signal_run + 1 if lo == 0.0 and hi == 0.0 else 0
        if self.no_signal_run >= c.no_signal_steps:
            zero_std = (row.get("algo") or {}).get("frac_reward_zero_std")
            groups = "every prompt group's samples scored the same" if zero_std in (None, 1.0) else \
                f"{100 * zero_std:.0f}% of the prompt groups' samples scored the same"
            firing["no_signal"] = (
                f"every advantage has been 0 for {self.no_signal_run} steps: {groups} (mean reward "
                f"{float(row['reward_mean']):.3f}), so the reward moves nothing. If that is the task's top score it is "
                f"learnt (stop, or train on harder prompts); otherwise check that the reward function scores different "
                f"responses differently (trainer.sample_log_freq writes them to samples.jsonl), or make the samples "
                f"differ more: a higher rollout.temperature, a larger algorithm.rollout_n, or "
                f"algorithm.dynamic_sampling=true (keep only groups whose scores differ).")

        tr = row.get("response_clip_frac")
        if tr is not None:
            self.truncated_min = tr if self.truncated_min is None else min(self.truncated_min, tr)
            if tr >= c.truncated_max and tr - self.truncated_min >= c.truncated_rise and \
                    recent <= self.best_recent - c.reward_drop:
                firing["length_blowup"] = (
                    f"{100 * tr:.0f}% of responses are cut at rollout.max_new_tokens (lowest so far "
                    f"{100 * self.truncated_min:.0f}%) and the reward fell ({self.best_recent:.3f} -> {recent:.3f}): "
                    f"the policy is losing EOS. Try algorithm.overlong_buffer_len>0 (DAPO's soft overlong penalty) "
                    f"or a length-aware reward.")

        rkl = row.get("rollout_kl")
        # samples from older weights (trainer.mode=one_step_off|async) differ by the policy's own
        # change as well: only steps trained on samples of the current weights are judged
        stale = (row.get("staleness") or {}).get("max", 0)
        if rkl is not None and rkl > c.rollout_kl_max and not stale:
            firing["logprob_mismatch"] = (
                f"approx KL between rollout and trainer log-probs is {rkl:.4f} (> {c.rollout_kl_max}): the sampler "
                f"and the trainer disagree on the same weights (dtype, sampling params, stale weight sync). Check "
                f"rollout.verify_sync=true and that rollout.temperature matches.")

        val = row.get("val_accuracy")
        val = row.get("val_reward") if val is None else val
        if val is not None:
            if self.best_val is None or val > self.best_val:
                self.best_val, self.reward_at_best_val = float(val), recent
            elif self.best_val - val >= c.val_drop and recent > self.reward_at_best_val:
                firing["val_drop"] = (
                    f"held-out score {val:.3f} is {self.best_val - val:.3f} below its best ({self.best_val:.3f}) "
                    f"while the training reward rose ({self.reward_at_best_val:.3f} -> {recent:.3f}): the policy is "
                    f"overfitting the training prompts or hacking the reward. Keep the best checkpoint.")

        algo = row.get("algo") or {}
        bad, bad_value = int(algo.get("nonfinite_updates") or 0), int(algo.get("value_nonfinite_updates") or 0)
        if bad or bad_value:
            what = " and ".join(x for x in (f"{bad} policy" if bad else "", f"{bad_value} critic" if bad_value else "")
                                if x)
            firing["nonfinite_grad"] = (
                f"{what} update(s) of {algo.get('updates', '?')} had a nan/inf gradient norm and were skipped (the "
                f"weights stay as they were). Lower optim.lr (or critic.lr), keep optim.grad_clip > 0, check the "
                f"reward for nan/inf, or use model.dtype=float32.")

        new = [Alarm(k, step, m) for k, m in firing.items() if k not in self.active]
        self.active = set(firing)
        return new
