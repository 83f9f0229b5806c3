"""The tensors that flow through one RL step.

A ``SequenceBatch`` is right-padded [B, T] token ids for prompt+response with masks; it is
what rollout returns and what engines consume. Everything here is plain torch on CPU so it
crosses Ray process boundaries cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

# what padding holds in a routing record (engine/moe/routing_records.py): a sequence's fields
# pad here, so the batch owns the value and the MoE records take it from here
NO_RECORD = -1


@dataclass
class SequenceBatch:
    """B sequences, each prompt tokens then response tokens, right-padded to T.

    input_ids        [B, T] long, pad where attention_mask == 0
    attention_mask   [B, T] long, 1 for real tokens (prompt and response)
    response_mask    [B, T] float, 1 on response tokens that count in the loss
    prompt_lengths   [B] long
    rollout_log_probs [B, T] float, log p(token_t | <t) from the sampler at position t (0 elsewhere)
    advantages       [B, T] float (set by the algorithm)
    old_log_probs / ref_log_probs [B, T] float (set before the update; meaningful only where
                     response_mask is 1: engine.fused_lm_head leaves every other position 0)
    values / returns [B, T] float (PPO: the critic's values and GAE targets)
    routed_experts   [B, T, L, k] int16 (algorithm.router_replay): the rollout's top-k experts per
                     token and routed layer (engine/moe/routing_records.py); padding holds no record

    Tensors with more than two dims are per-token along dim 1 like the others; padding them
    fills ``pad_fill(name)``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None      # PPO: the critic's V(tokens < t) before the update
    returns: Optional[torch.Tensor] = None     # PPO: GAE value targets
    routed_experts: Optional[torch.Tensor] = None  # MoE routing replay: [B, T, L, k] int16
    versions_behind: Optional[torch.Tensor] = None  # [B, T] float: policy versions between each row's sampling weights and the trained ones (trainer.mode samples ahead)
    extras: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(-1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    def tensor_fields(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def to(self, device) -> "SequenceBatch":
        """The same rows on ``device`` (self when already there)."""
        if all(getattr(self, n).device == torch.device(device) for n in self.tensor_fields()):
            return self
        return SequenceBatch(**{n: getattr(self, n).to(device) for n in self.tensor_fields()}, extras=self.extras)

    def select(self, index) -> "SequenceBatch":
        """Rows ``index`` (a list/tensor of ints or a slice), trimmed to their longest row."""
        out = {name: getattr(self, name)[index] for name in self.tensor_fields()}
        kept = SequenceBatch(**out, extras=dict(self.extras))
        return kept.trim()

    def trim(self) -> "SequenceBatch":
        """Drop trailing columns that are padding in every row."""
        if len(self) == 0:
            return self
        t = int(self.attention_mask.sum(-1).max())
        for name in self.tensor_fields():
            v = getattr(self, name)
            if v.dim() >= 2 and v.shape[1] > t:
                setattr(self, name, v[:, :t].contiguous())
        return self

    @staticmethod
    def concat(batches: list["SequenceBatch"], pad_token_id: int = 0) -> "SequenceBatch":
        """Stack batches row-wise, right-padding each to the longest."""
        t = max(int(b.input_ids.shape[1]) for b in batches)
        names = [n for n in batches[0].tensor_fields()]
        out = {}
        for name in names:
            parts = []
            for b in batches:
                v = getattr(b, name)
                if v.dim() >= 2 and v.shape[1] < t:
                    v = pad_tokens(v, t, pad_fill(name, pad_token_id))
                parts.append(v)
            out[name] = torch.cat(parts, 0)
        return SequenceBatch(**out, extras=dict(batches[0].extras))


def pad_fill(name: str, pad_token_id: int = 0) -> int:
    """What padding holds in field ``name``: the pad token (input_ids), no record (routed_experts), else 0."""
    if name == "input_ids":
        return pad_token_id
    if name == "routed_experts":
        return NO_RECORD
    return 0


def pad_tokens(v: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Right-pad the token dim (dim 1) of a [B, T, ...] tensor to ``width`` with ``fill``."""
    if v.shape[1] >= width:
        return v
    extra = v.new_full((v.shape[0], width - v.shape[1]) + tuple(v.shape[2:]), fill)
    return torch.cat([v, extra], 1)
