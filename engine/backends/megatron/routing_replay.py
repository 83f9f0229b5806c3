"""Routing replay in a megatron-core MoE ``GPTModel`` (algorithm.router_replay, docs/moe.md).

megatron-core 0.16 has its own routing replay (``moe_enable_routing_replay=True``): every
``TopKRouter`` gets a ``megatron.core.transformer.moe.router_replay.RouterReplay`` through which
its top-k goes (``get_replay_topk(scores, k, ..., default_compute_topk)``). Its REPLAY actions
replace the top-k of *every* token, and its backward replay pops one tensor per recomputation.
rl needs two things it lacks: tokens without a record (pads, each response's last token) take
the router's own choice, and one binding serves the forward and any recomputation in backward.
So this module goes through the same per-router ``RouterReplay`` objects megatron builds, and
sets their ``get_replay_topk`` to one that computes the router's own top-k, replaces it by the
record where a token has one, and gathers the router's scores at the chosen experts, exactly
what megatron's REPLAY_FORWARD does (for Mixtral's softmax-after-top-k router the scores are the
logits; megatron then softmaxes the k gathered logits, i.e. the renormalised probabilities of
the recorded experts, so the router keeps getting gradients).

Token order: megatron runs ``[s, b, h]`` and its router flattens that, so token ``t*b + i`` is
row i's position t (sequence-major). The rollout's records are ``[B, T, L, k]`` (row-major);
``sequence_first`` re-lays them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.moe.routing_records import has_record, to_records


def sequence_first(records: torch.Tensor) -> torch.Tensor:
    """``[B, T, L, k]`` records -> ``[T*B, L, k]`` in megatron's token order."""
    b, t = records.shape[:2]
    return records.transpose(0, 1).reshape(t * b, *records.shape[2:])


def batch_first(flat: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """Inverse of ``sequence_first``: ``[T*B, L, k]`` -> ``[B, T, L, k]``."""
    return flat.reshape(t, b, *flat.shape[1:]).transpose(0, 1)


class MegatronRoutingReplay:
    """Replay/capture through megatron's per-router ``RouterReplay`` of one ``GPTModel``."""

    def __init__(self, gpt_model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in gpt_model.modules() if isinstance(m, TopKRouter)]
        if not routers or any(getattr(r, "router_replay", None) is None for r in routers):
            raise ValueError("the model's routers were built without moe_enable_routing_replay")
        self.layers, self.top_k = len(routers), routers[0].topk
        self._records: tuple[torch.Tensor, torch.Tensor] | None = None  # [N, L, k] long, [N] bool
        self._capture = False
        self._captured: list = [None] * self.layers
        for i, r in enumerate(routers):
            r.router_replay.get_replay_topk = self._topk(i)

    def _topk(self, layer: int):
        def topk(scores, k, num_groups=None, group_topk=None, default_compute_topk=None):
            values, own = default_compute_topk(scores, k, num_groups=num_groups, group_topk=group_topk)
            if self._capture:
                self._captured[layer] = own.detach()
            if self._records is None:
                return values, own
            rec, use = self._records
            if rec.shape[0] != own.shape[0]:
                raise RuntimeError(f"routing records for {rec.shape[0]} tokens, but layer {layer}'s router got "
                                   f"{own.shape[0]}: the records must be laid out like the forward's input")
            chosen = torch.where(use[:, None], rec[:, layer].to(own.dtype), own)
            return scores.gather(1, chosen), chosen
        return topk

    @contextmanager
    def replaying(self, records: torch.Tensor, device=None, capture: bool = False):
        """Replay ``records`` ([B, T, L, k], the batch's layout) in every forward inside the context
        and in backward's recomputation (keep the backward inside). ``capture``: keep the routers'
        own choices for ``take``."""
        if tuple(records.shape[-2:]) != (self.layers, self.top_k):
            raise ValueError(f"routing records end in {tuple(records.shape[-2:])}, this model routes "
                             f"{self.layers} layers x top-{self.top_k}")
        flat = sequence_first(records)
        self._records = (flat.to(device=device, dtype=torch.long), has_record(flat).all(-1).to(device))
        self._capture, self._captured = capture, [None] * self.layers
        try:
            yield self
        finally:
            self._records = None
            self._capture, self._captured = False, [None] * self.layers

    @contextmanager
    def recording(self):
        """Capture every router's own choice; read the forward's with ``take``."""
        self._capture, self._captured = True, [None] * self.layers
        try:
            yield self
        finally:
            self._capture, self._captured = False, [None] * self.layers

    def take(self, b: int, t: int) -> torch.Tensor:
        """The last forward's own choices as ``[b, t, L, k]`` int16 records (batch order)."""
        if any(c is None for c in self._captured):
            raise RuntimeError("no routing captured: call take() after a forward inside recording()")
        out = torch.stack(self._captured, dim=1)
        self._captured = [None] * self.layers
        return batch_first(to_records(out), b, t)
