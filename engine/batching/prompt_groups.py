"""The prompt-grouped layout of a micro-batch: each distinct prompt once, responses apart.

GRPO samples ``n`` responses per prompt, so a padded [b, T] micro-batch repeats each prompt's
tokens ``n`` times, and a forward over it computes every prompt ``n`` times (at 16-token prompts
and 32-token responses, about a quarter of the update's FLOPs). This layout lets a backend run
the prompts once (left-padded [u, P], with a KV cache), copy the cache to the ``b`` rows, then
run the responses ([b, R], right-padded) against it; gradients flow back through the copy into
the single prompt forward, so the result is the same as the plain forward.

``to_response_columns`` / the ``cols`` index map per-token tensors of the [b, T] layout to
the [b, R] response layout (response token j of row i is column ``prompt_len[i] + j``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import SequenceBatch


@dataclass
class PromptGroups:
    prompt_ids: torch.Tensor        # [u, P] long, left-padded distinct prompts
    prompt_mask: torch.Tensor       # [u, P] long
    prompt_positions: torch.Tensor  # [u, P] long, 0 at each prompt's first real token
    owner: torch.Tensor             # [b] long, the distinct prompt of each row
    response_ids: torch.Tensor      # [b, R] long, right-padded (pad_token_id)
    response_mask: torch.Tensor     # [b, R] long, 1 on real response tokens
    response_positions: torch.Tensor  # [b, R] long, prompt_len + j
    cols: torch.Tensor              # [b, R] long, column of response token j in the [b, T] layout

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def fed(self) -> int:
        """Response columns the responses' forward is fed: all but the last, whose output would
        predict a token after the longest response (nothing)."""
        return int(self.response_ids.shape[1]) - 1

    @property
    def tokens(self) -> int:
        """Tokens the model computes: the distinct prompts once, plus every fed response slot."""
        return int(self.prompt_ids.numel() + self.response_ids.shape[0] * self.fed)


def group_prompts(batch: SequenceBatch, pad_token_id: int) -> PromptGroups | None:
    """The grouped layout of ``batch``, or None when no prompt repeats (nothing to share) or a
    row has no response token."""
    plen = batch.prompt_lengths.long()
    seq = batch.attention_mask.sum(-1).long()
    rlen = seq - plen
    if len(batch) == 0 or int(rlen.min()) < 1:
        return None
    index: dict[tuple, int] = {}
    owner = []
    prompts = []
    for i in range(len(batch)):
        key = tuple(batch.input_ids[i, : int(plen[i])].tolist())
        if key not in index:
            index[key] = len(prompts)
            prompts.append(key)
        owner.append(index[key])
    if len(prompts) == len(batch):
        return None
    u, P, R = len(prompts), max(len(p) for p in prompts), int(rlen.max())
    prompt_ids = torch.full((u, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((u, P), dtype=torch.long)
    for k, p in enumerate(prompts):
        prompt_ids[k, P - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[k, P - len(p):] = 1
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    j = torch.arange(R)[None, :]
    valid = j < rlen[:, None]
    cols = (plen[:, None] + j).clamp(max=batch.input_ids.shape[1] - 1)
    response_ids = torch.where(valid, batch.input_ids.gather(1, cols), torch.full_like(cols, pad_token_id))
    return PromptGroups(prompt_ids, prompt_mask, prompt_positions, torch.tensor(owner, dtype=torch.long),
                        response_ids, valid.long(), plen[:, None] + j, cols)


def to_response_columns(batch: SequenceBatch, groups: PromptGroups) -> SequenceBatch:
    """``batch`` with every [b, T] per-token tensor re-laid as [b, R] response columns (masks,
    advantages, old/ref log-probs), for a loss computed on the grouped layout's log-probs."""
    out = {}
    valid = groups.response_mask
    for name in batch.tensor_fields():
        v = getattr(batch, name)
        if v.dim() == 2 and v.shape == batch.input_ids.shape:
            g = v.gather(1, groups.cols)
            out[name] = torch.where(valid.bool(), g, torch.zeros_like(g))
        else:
            out[name] = v
    out["input_ids"] = groups.response_ids
    out["attention_mask"] = valid
    out["prompt_lengths"] = torch.zeros_like(batch.prompt_lengths)
    return SequenceBatch(**out, extras=dict(batch.extras))


def group_records(routed: torch.Tensor, groups: PromptGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """The [b, T, L, k] routing records of a micro-batch (engine/moe/routing_records.py) laid out
    like the grouped forwards: prompts [u, P, L, k] left-padded (from each prompt's first row:
    rows sharing a prompt shared its prefill in the rollout) and the fed responses
    [b, R - 1, L, k] (``PromptGroups.fed``); padding holds no record."""
    from engine.moe.routing_records import NO_RECORD

    u, P = groups.prompt_ids.shape
    tail = tuple(routed.shape[2:])
    prompts = routed.new_full((u, P) + tail, NO_RECORD)
    plen = groups.prompt_mask.sum(-1)
    seen = set()
    for row, k in enumerate(groups.owner.tolist()):
        if k not in seen:
            seen.add(k)
            n = int(plen[k])
            prompts[k, P - n:] = routed[row, :n]
    cols = groups.cols
    idx = cols.reshape(cols.shape + (1,) * len(tail)).expand(cols.shape + tail)
    responses = routed.gather(1, idx)
    valid = groups.response_mask.bool().reshape(cols.shape + (1,) * len(tail))
    responses = torch.where(valid, responses, torch.full_like(responses, NO_RECORD))
    return prompts, responses[:, :groups.fed]
