"""What `rl eval` measured: per data source and overall, the greedy pass's accuracy and mean
reward, the sampled pass's mean accuracy, mean reward and pass@k; the rows of its table and its
--json (engine/evaluate/run.py fills it, rlcli/render/eval.py draws it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

JSON_VERSION = 1


@dataclass
class Scores:
    """One data source's results (or all of them: ``data_source="all"``)."""

    data_source: str
    prompts: int
    greedy_accuracy: Optional[float] = None   # share of prompts whose greedy response is correct
    greedy_reward: Optional[float] = None     # mean reward of the greedy responses
    sampled_accuracy: Optional[float] = None  # share of sampled responses that are correct
    sampled_reward: Optional[float] = None    # mean reward of the sampled responses
    pass_at_k: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        greedy = None if self.greedy_reward is None else {"accuracy": self.greedy_accuracy,
                                                          "reward": self.greedy_reward}
        sampled = None if self.sampled_reward is None else {
            "accuracy": self.sampled_accuracy, "reward": self.sampled_reward,
            "pass_at_k": {str(k): v for k, v in sorted(self.pass_at_k.items())}}
        return {"data_source": self.data_source, "prompts": self.prompts, "greedy": greedy, "sampled": sampled}


@dataclass
class EvalResult:
    source: dict                 # engine.evaluate.model_source.ModelSource.to_json()
    task: str
    split: str
    prompts: int
    greedy: bool
    n: int                       # sampled responses per prompt (0: no sampled pass)
    k: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    sampler: str                 # torch or vllm
    device: str
    correct_from: str            # "the task's correctness check" or "reward >= <eval.pass_threshold>"
    overall: Scores
    by_source: list[Scores]
    responses: int               # rows written to ``output`` (greedy + sampled)
    reward_failures: int         # calls that failed and scored 0 (task.reward_on_error=zero)
    output: Optional[str]        # eval.jsonl (None: eval.output is empty)
    seconds: float
    reward: str = ""             # the reward functions, as the run describes them

    def to_json(self) -> dict:
        return {"version": JSON_VERSION, "source": self.source, "task": self.task, "split": self.split,
                "prompts": self.prompts, "reward": self.reward, "correct_from": self.correct_from,
                "sampling": {"greedy": self.greedy, "n": self.n, "k": list(self.k), "temperature": self.temperature,
                             "top_p": self.top_p, "max_new_tokens": self.max_new_tokens, "sampler": self.sampler,
                             "device": self.device},
                "overall": self.overall.to_json(), "by_data_source": [s.to_json() for s in self.by_source],
                "responses": self.responses, "reward_failures": self.reward_failures, "output": self.output,
                "seconds": self.seconds}
