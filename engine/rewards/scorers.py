"""Reward sources that score a whole batch at once: a reward model (engine/reward_model/) or a
remote HTTP scorer (engine/rewards/remote.py), beside the reward functions.

A scorer has a ``name`` (its metric), a ``weight`` (its share of the reward) and
``score(samples) -> list[float]``, one finite float per sample. A batch it cannot score raises
``ScorerFailed`` with the reason; the runner (engine/rewards/compute.py) then applies
``task.reward_on_error`` to that batch's samples as it does to a failing function call: ``raise``
stops the run naming the scorer, ``zero`` scores them 0 and counts them.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Protocol, Sequence

from engine.rewards.call import Sample


class ScorerFailed(Exception):
    """Samples a scorer could not score: ``rows`` (indices into the samples it was given), why,
    and the scores of the rows it did score (``partial``: index -> score)."""

    def __init__(self, message: str, rows: Sequence[int], partial: Optional[dict] = None):
        super().__init__(message)
        self.rows = list(rows)
        self.partial = dict(partial or {})


class BatchScorer(Protocol):
    name: str      # "reward_model" or "reward_url": the metric each is logged under
    weight: float

    def score(self, samples: list[Sample]) -> list[float]:
        """One finite score per sample, in order; raises ScorerFailed for what it could not score."""

    def describe(self) -> str:
        """One line for the run plan: what scores, where."""

    def close(self) -> None:
        """Release what the scorer holds (a model, an actor, connections)."""


def finite_scores(values: object, n: int, what: str) -> list[float]:
    """``values`` as ``n`` finite floats, or ValueError saying what is wrong (``what`` names the source)."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{what} returned {type(values).__name__}, not a list of {n} scores")
    if len(values) != n:
        raise ValueError(f"{what} returned {len(values)} score(s) for {n} sample(s)")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{what} returned {v!r:.60} for sample {i}, not a number")
        if not math.isfinite(float(v)):
            raise ValueError(f"{what} returned {v} for sample {i}; a reward must be finite")
        out.append(float(v))
    return out


def conversation(prompt: object, response: str) -> list[dict]:
    """A sample as chat messages: the prompt's messages (or one user message) and the response."""
    msgs = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    return msgs + [{"role": "assistant", "content": response}]


def plain_text(prompt: object, response: str) -> str:
    """A sample as one text without a chat template: the prompt (a message prompt's contents,
    one per line) followed directly by the response, as the policy saw and wrote it."""
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return f"{prompt}{response}"


def as_policy_saw(tokenizer) -> Callable[[object, str], str]:
    """(prompt, response) -> the text of the whole sequence as the policy saw and wrote it: its
    tokenizer's chat template applied to the conversation where the prompt was templated (a
    message prompt; a text prompt with task.chat_template=true), else prompt + response."""
    hf = getattr(tokenizer, "tok", None)  # engine.model.tokenizer.HFTokenizer's transformers tokenizer
    if hf is None or getattr(hf, "chat_template", None) is None:
        return plain_text
    text_templated = bool(getattr(tokenizer, "chat_template", False))

    def render(prompt: object, response: str) -> str:
        if isinstance(prompt, list) or text_templated:
            return hf.apply_chat_template(conversation(prompt, response), tokenize=False)
        return plain_text(prompt, response)
    return render
