"""Record and replay the expert choices of a mixture-of-experts model's routers.

One forward hook per router (engine/moe/routers.py). Outside ``recording``/``replaying`` the
hooks do nothing. Inside:

- ``recording()``: each router's own top-k indices are kept; ``take()`` returns them as one
  ``[tokens, layers, k]`` int16 record for the forward that just ran (tokens in the order the
  model flattened them: row-major over its ``[b, s]`` input).
- ``replaying(records)``: ``records`` is ``[b, s, layers, k]`` (or ``[tokens, layers, k]``)
  matching the forward's input. Where a token has a record (engine/moe/routing_records.py) the
  router's top-k indices are replaced by the recorded ones and the gate weights recomputed from
  the router's own logits at those indices, exactly as the router computes them (softmax in
  fp32, gather, renormalise when the router does, cast to the router's output dtype), so the
  router still receives gradients; tokens without a record (padding) keep the router's choice.
  The router's own choice is captured as well, for the routing-mismatch metrics. Several
  record tensors can be bound at once for forwards of different token counts (the prompt-shared
  update runs the prompts, then the responses); each router call takes the one matching its
  token count.

The records stay bound until the context exits, so gradient checkpointing's recomputation in
backward replays the same experts: keep the backward inside the context.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from engine.moe.routers import MoELayout, find_routers, moe_layout
from engine.moe.routing_records import MAX_EXPERTS, has_record, to_records

_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, RouterReplay]" = weakref.WeakKeyDictionary()


def gate_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The router's gate weights for experts ``indices`` [N, k], from its logits [N, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(out_dtype)


class RouterReplay:
    """Hooks on every router of ``model``; attach once per model (``attach``)."""

    def __init__(self, model: torch.nn.Module):
        layout = moe_layout(model)
        if layout is None:
            raise ValueError("the model has no supported mixture-of-experts router (engine/moe/routers.py)")
        if layout.num_experts > MAX_EXPERTS:
            raise ValueError(f"{layout.num_experts} experts do not fit int16 routing records (at most {MAX_EXPERTS})")
        self.layout: MoELayout = layout
        self._captured: list = [None] * layout.layers
        self._capture = False
        # tokens per forward -> ([N, L, k] int16 records on the model's device, [N] bool: has a record)
        self._replay: dict | None = None
        self._handles = [m.register_forward_hook(self._hook(i))
                         for i, (_, m) in enumerate(find_routers(model))]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- hooks --------------------------------------------------------------------------
    def _hook(self, layer: int):
        def hook(module, args, out):
            if not self._capture and self._replay is None:
                return None
            logits, scores, indices = out
            if self._capture:
                self._captured[layer] = indices.detach()
            if self._replay is None:
                return None
            n = indices.shape[0]
            if n not in self._replay:
                raise RuntimeError(f"routing records bound for forwards of {sorted(self._replay)} tokens, but layer "
                                   f"{layer}'s router got {n}: the records must be laid out like the forward's input")
            flat, use = self._replay[n]
            rec = flat[:, layer].to(indices.dtype)
            if rec.shape != indices.shape:
                raise RuntimeError(f"routing records are top-{rec.shape[1]}, layer {layer}'s router is top-"
                                   f"{indices.shape[1]}")
            chosen = torch.where(use[:, None], rec, indices)
            return logits, gate_weights(module, logits, chosen, scores.dtype), chosen
        return hook

    # ---- modes --------------------------------------------------------------------------
    @contextmanager
    def recording(self):
        """Capture every router's own choice; read each forward's with ``take()``."""
        self._capture, self._captured = True, [None] * self.layout.layers
        try:
            yield self
        finally:
            self._capture, self._captured = False, [None] * self.layout.layers

    def take(self, as_records: bool = True) -> torch.Tensor:
        """The last forward's choices as ``[tokens, layers, k]``: int16 on CPU (records), or the
        router's indices on their device (``as_records=False``)."""
        if any(c is None for c in self._captured):
            raise RuntimeError("no routing captured: call take() after a forward inside recording()/replaying()")
        out = torch.stack(self._captured, dim=1)
        self._captured = [None] * self.layout.layers
        return to_records(out) if as_records else out

    @contextmanager
    def replaying(self, *records: torch.Tensor, device=None, capture: bool = False):
        """Replay ``records`` ([b, s, L, k] or [N, L, k]) in every forward inside the context
        (and in gradient checkpointing's recomputation). Several record tensors serve several
        forwards of different token counts (the prompt-shared update: prompts, then responses);
        each router call takes the one whose token count it sees. ``capture``: also keep the
        routers' own choices for ``take()``."""
        L, k = self.layout.layers, self.layout.top_k
        bound = {}
        for r in records:
            if tuple(r.shape[-2:]) != (L, k):
                raise ValueError(f"routing records end in {tuple(r.shape[-2:])}, this model routes "
                                 f"{L} layers x top-{k}")
            flat = r.reshape(-1, L, k)
            if flat.shape[0] in bound:
                raise ValueError(f"two record tensors for forwards of {flat.shape[0]} tokens: ambiguous")
            dev = device if device is not None else r.device
            # a token replays where it has a record in every layer (the rollout writes all layers
            # of a token at once); padding has none in any
            bound[flat.shape[0]] = (flat.to(device=dev), has_record(flat).all(-1).to(dev))
        self._replay = bound
        self._capture, self._captured = capture, [None] * L
        try:
            yield self
        finally:
            self._replay = None
            self._capture, self._captured = False, [None] * L


def attach(model: torch.nn.Module) -> RouterReplay:
    """The model's RouterReplay, creating (and hooking) it on first use."""
    rr = _ATTACHED.get(model)
    if rr is None:
        rr = _ATTACHED[model] = RouterReplay(model)
    return rr


def attached(model: torch.nn.Module) -> RouterReplay | None:
    """The RouterReplay attached to ``model`` (None: none was)."""
    return _ATTACHED.get(model)
