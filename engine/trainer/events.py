"""What a run reports as it goes. The CLI renders these; the engine never prints tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    memory: list = field(default_factory=list)      # per-rank, per-phase memory records
    algo: dict = field(default_factory=dict)        # estimator extras (dynamic sampling, overlong penalty, ...)
    reward_fns: dict = field(default_factory=dict)  # several reward functions: each one's mean (unweighted)
    reward_failures: int = 0                        # reward calls that raised/hung, scored 0 (reward_on_error=zero)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("memory")  # written to memory.jsonl, not metrics.jsonl
        return d


@dataclass
class Validation:
    step: int
    accuracy: float | None
    reward: float
    correct: list | None = None     # per held-out problem, in order (when the task defines it)
    rewards: list | None = None     # per held-out problem, in order
    reward_failures: int = 0

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

    @property
    def improvement(self) -> float:
        return self.reward_last10 / self.reward_first10 if self.reward_first10 > 0 else float("inf")

    def to_json(self) -> dict:
        return asdict(self) | {"improvement": self.improvement}
