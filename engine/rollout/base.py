"""The rollout interface: prompts in, sampled sequences with their log-probs out."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.batch import SequenceBatch


class Sampler(ABC):
    """Generates ``n`` responses per prompt.

    Returns a SequenceBatch with rows ordered prompt-major (prompt 0's n samples first),
    ``rollout_log_probs[b, t]`` = log p(input_ids[b, t] | <t) under the sampling
    distribution (after temperature; before top-p truncation) on response positions.
    Implements engine/interfaces.py RolloutSampler; the defaults below suit a sampler that
    reads the engine's live model (the torch sampler).
    """

    reads_live_model: bool = True
    last_kv_cache_bytes: int = 0
    last_sync: dict = {}
    # besides EOS (set_ends): a tool call's end marker (stop_token_ids, kept in the response) and the
    # model's other end tokens (end_token_ids: its generation_config.json's eos_token_id beside the
    # tokenizer's eos, e.g. Gemma's <end_of_turn>), which end a response as EOS does and
    # rollout.ignore_eos forbids too
    stop_token_ids: tuple[int, ...] = ()
    end_token_ids: tuple[int, ...] = ()

    def set_ends(self, vocab: dict) -> None:
        """What ends a response, from the run's vocab: the model's end tokens besides ``eos``
        (``vocab["ends"]``) and a tool call's end (``vocab["stops"]``, engine/agents)."""
        self.end_token_ids = tuple(i for i in vocab.get("ends", ()) if i != vocab.get("eos"))
        self.stop_token_ids = tuple(vocab.get("stops", ()))

    @abstractmethod
    def generate(self, model: torch.nn.Module | None, prompts: list[list[int]], n: int,
                 generator: torch.Generator, greedy: bool = False) -> SequenceBatch:
        ...

    def generate_pieces(self, model: torch.nn.Module | None, prompts: list[list[int]], n: int,
                        generator: torch.Generator, greedy: bool = False, stream: bool = False):
        """``generate``'s rows as ``(first row, SequenceBatch)`` pieces (trainer.stream_groups); a
        sampler that cannot stream yields the whole batch as one piece."""
        yield 0, self.generate(model, prompts, n, generator, greedy=greedy)

    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Push new policy weights into the rollout engine; returns seconds spent.
        The torch sampler reads the live model, so this is a no-op there."""
        return 0.0

    def verify_sync(self, engine, batch: SequenceBatch):
        """Check the rollout engine's log-probs equal the trainer's after a sync (raises on mismatch)."""
        raise NotImplementedError(f"{type(self).__name__} reads the live model: there is no synced copy to verify")

    def memory(self) -> dict | None:
        """Memory the rollout engine holds outside the trainer's model (None: nothing of its own)."""
        return None

    def sleep(self) -> None:
        """Free the rollout engine's device memory until the next sync (no-op without one)."""

    def shutdown(self) -> None:
        """Stop the rollout engine's processes (no-op without any)."""
