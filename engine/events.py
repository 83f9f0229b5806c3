"""What a run reports as it goes. The CLI renders these; the engine never prints tables."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields


@dataclass
class RunPlan:
    engine: str
    model: str
    num_params: int
    ranks: int
    dp_size: int
    device: str
    task: str
    num_train: int
    num_val: int
    total_steps: int
    start_step: int
    rollout: str
    key_settings: dict          # key -> value for the hyper-parameters people check first
    changed: dict               # key -> (before, now): before = the default, or the checkpoint's value on resume
    run_dir: str
    changed_from: str = "default"   # what `before` in `changed` is: "default" or "checkpoint"
    data: str = ""                  # dataset tasks: source, detected format, dropped prompts
    reward: str = ""                # reward functions, weights, workers
    ray: str = ""                   # which Ray the run uses (private local, or the cluster and why)
    placement: list = field(default_factory=list)  # per rank: node_id, node_ip, hostname, pid

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StepRecord:
    step: int
    reward_mean: float
    accuracy: float | None
    kl: float | None
    pg_loss: float
    entropy: float | None
    grad_norm: float
    lr: float
    response_len_mean: float
    rollout_tokens_per_s: float
    update_tokens_per_s: float
    step_time_s: float
    peak_mem_bytes: int
    pad_fraction: float
    distinct_shapes: int
    timing: dict = field(default_factory=dict)     # phase -> seconds
    micro_batch_shapes: list = field(default_factory=list)  # distinct [rows, length] trained on
    val_accuracy: float | None = None
    val_reward: float | None = None
    checkpoint: str | None = None
    # added with trainer.loggers (docs/tracking.md); None in rows written before them
    clip_frac: float | None = None          # fraction of response tokens where the PPO clip was active
    rollout_kl: float | None = None         # KL(rollout sampler || trainer) on the sampled tokens (k3)
    adv_mean: float | None = None           # per-sequence advantages
    adv_std: float | None = None
    adv_min: float | None = None
    adv_max: float | None = None
    response_len_min: int | None = None
    response_len_max: int | None = None
    response_clip_frac: float | None = None  # responses cut at rollout.max_new_tokens (no EOS)
    samples_per_s: float | None = None      # responses per second of step time
    mem_peaks: dict = field(default_factory=dict)   # category/rss -> max bytes over ranks and phases
    memory: list = field(default_factory=list)      # per-rank, per-phase memory records
    algo: dict = field(default_factory=dict)        # estimator extras (dynamic sampling, overlong penalty, ...)
    reward_fns: dict = field(default_factory=dict)  # several reward functions: each one's mean (unweighted)
    reward_failures: int = 0                        # reward calls that raised/hung, scored 0 (reward_on_error=zero)
    samples: list = field(default_factory=list)     # SampleRow dicts (only on sample-logging steps)
    alarms: list = field(default_factory=list)      # alarms that started at this step ({kind, step, message})
    driver_bytes: dict = field(default_factory=dict)  # {"sent", "received"}: pickled bytes of the step's rank calls
    staleness: dict = field(default_factory=dict)  # trainer.mode samples ahead: versions and staleness (engine/algorithms/staleness.py)

    def to_json(self) -> dict:
        """The metrics.jsonl row: every field but memory (memory.jsonl) and samples
        (samples.jsonl), left out before the copy (asdict then pop copied them: ~0.8 ms a step)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in _NOT_IN_ROW}


_NOT_IN_ROW = ("memory", "samples")


@dataclass
class Validation:
    step: int
    accuracy: float | None
    reward: float
    correct: list | None = None     # per held-out problem, in order (when the task defines it)
    rewards: list | None = None     # per held-out problem, in order
    reward_failures: int = 0
    responses: list | None = None   # the greedy response text per held-out problem, in order

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class RunSummary:
    steps_run: int
    first_step: int
    last_step: int
    reward_first10: float
    reward_last10: float
    wall_time_s: float
    run_dir: str
    metrics_path: str
    checkpoints: list[str]
    val_before: float | None = None
    val_after: float | None = None
    tracking: dict = field(default_factory=dict)   # loggers used and the seconds they took
    alarms: list = field(default_factory=list)      # every alarm raised ({kind, step, message})
    stopped_by_alarm: str | None = None             # the alarm kind trainer.stop_on_alarm stopped on
    placement: list = field(default_factory=list)   # per rank: node_id, node_ip, hostname, pid
    versions_ahead: int = 0  # trainer.mode: how many updates the samples' policy may trail (0 = sync)

    @property
    def improvement(self) -> float | None:
        """last-10 / first-10 mean reward; None when the first is not positive (no ratio)."""
        return self.reward_last10 / self.reward_first10 if self.reward_first10 > 0 else None

    def to_json(self) -> dict:
        return asdict(self) | {"improvement": self.improvement}


@dataclass
class Samples:
    """Prompt/response/reward rows of one step (trainer.sample_log_freq), for samples.jsonl and loggers."""
    step: int
    rows: list      # {"step", "prompt", "response", "reward", "advantage", "answer"}


@dataclass
class RunProgress:
    """Where the run stands after a step (engine/tracking/eta.py computes it; the CLI draws a
    progress bar from it on a terminal)."""
    step: int                 # the step that just ended (start_step before the first)
    total_steps: int
    start_step: int           # 0, or the checkpoint's step on resume
    elapsed_s: float          # since this run's (or resume's) first step began
    step_s: float | None      # seconds per step: moving average of the last steps' wall times
    eta_s: float | None       # seconds until the last step ends; None before the first step

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class PhaseStarted:
    """A long phase began (the CLI shows a progress line until PhaseFinished)."""
    phase: str                       # load_model | load_checkpoint | save_checkpoint | validation
    label: str                       # what to show, e.g. "save checkpoint step_20"
    total_bytes: int | None = None   # known size (checkpoint load, model files), else None
    step: int | None = None


@dataclass
class PhaseProgress:
    phase: str
    done_bytes: int


@dataclass
class PhaseFinished:
    phase: str
    label: str
    seconds: float
    bytes: int | None = None
    step: int | None = None


@dataclass
class Notice:
    """Something the user should know that is not an error (a stale lock taken over, an old
    run replaced)."""

    text: str

    def to_json(self) -> dict:
        return asdict(self)
