"""Batched sampling with a KV cache on any HF-style causal LM (the built-in rollout).

Prompts are left-padded for generation (positions start at 0 at each prompt's first real
token), then rows are re-laid right-padded as prompt+response for training, with the
sampler's per-token log-probs at response positions.
"""

from __future__ import annotations

import torch

from engine.batch import SequenceBatch
from engine.config.schema import RolloutConfig
from engine.rollout.base import Sampler


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


class TorchSampler(Sampler):
    def __init__(self, cfg: RolloutConfig, pad_token_id: int, eos_token_id: int, device: torch.device):
        self.cfg = cfg
        self.pad = pad_token_id
        self.eos = eos_token_id
        self.device = device
        self.last_kv_cache_bytes = 0

    @torch.no_grad()
    def generate(self, model, prompts: list[list[int]], n: int, generator: torch.Generator,
                 greedy: bool = False) -> SequenceBatch:
        rows = [p for p in prompts for _ in range(n)]
        chunk = self.cfg.micro_batch_size or len(rows)
        parts = [self._generate_chunk(model, rows[i:i + chunk], generator, greedy)
                 for i in range(0, len(rows), chunk)]
        return SequenceBatch.concat(parts, self.pad) if len(parts) > 1 else parts[0]

    def _generate_chunk(self, model, rows: list[list[int]], generator, greedy: bool) -> SequenceBatch:
        dev, B = self.device, len(rows)
        P = max(len(r) for r in rows)
        ids = torch.full((B, P), self.pad, dtype=torch.long)
        attn = torch.zeros((B, P), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, P - len(r):] = torch.tensor(r)
            attn[i, P - len(r):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        temp = max(self.cfg.temperature, 1e-6)
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache, logits = _returned_cache(out), out.logits[:, -1, :].float()
        next_pos = pos[:, -1:] + 1
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        tokens, logps, alive = [], [], []
        for _ in range(self.cfg.max_new_tokens):
            logp = torch.log_softmax(logits / temp, dim=-1)
            if greedy:
                tok = logits.argmax(-1)
            else:
                probs = _top_p_filter(logits / temp, self.cfg.top_p).softmax(-1)
                tok = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(dev)
            tok = torch.where(done, torch.full_like(tok, self.pad), tok)
            tokens.append(tok)
            logps.append(torch.where(done, torch.zeros(B, device=dev), logp.gather(-1, tok[:, None]).squeeze(-1)))
            alive.append(~done)
            done = done | (tok == self.eos)
            if bool(done.all()):
                break
            attn = torch.cat([attn, (~done | (tok == self.eos)).long()[:, None]], dim=1)
            attn[:, -1] = 1  # the token just sampled is visible to the next step
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                        use_cache=True, **{_cache_kwarg(model): cache})
            cache, logits = _returned_cache(out), out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        self.last_kv_cache_bytes = _cache_bytes(cache)
        resp = torch.stack(tokens, 1).cpu()
        resp_lp = torch.stack(logps, 1).cpu()
        resp_alive = torch.stack(alive, 1).cpu()
        return self._to_right_padded(rows, resp, resp_lp, resp_alive)

    def _to_right_padded(self, rows, resp, resp_lp, resp_alive) -> SequenceBatch:
        B = len(rows)
        lens_r = resp_alive.sum(-1)
        T = max(len(r) + int(l) for r, l in zip(rows, lens_r))
        input_ids = torch.full((B, T), self.pad, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        rmask = torch.zeros((B, T), dtype=torch.float32)
        lp = torch.zeros((B, T), dtype=torch.float32)
        for i, r in enumerate(rows):
            p, l = len(r), int(lens_r[i])
            input_ids[i, :p] = torch.tensor(r)
            input_ids[i, p:p + l] = resp[i, :l]
            attn[i, :p + l] = 1
            rmask[i, p:p + l] = 1.0
            lp[i, p:p + l] = resp_lp[i, :l]
        return SequenceBatch(input_ids=input_ids, attention_mask=attn, response_mask=rmask,
                             prompt_lengths=torch.tensor([len(r) for r in rows]), rollout_log_probs=lp)


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x renamed past_key_values to cache; accept both."""
    import inspect

    fwd = getattr(model, "forward", model)
    params = inspect.signature(fwd).parameters
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _cache_bytes(cache) -> int:
    total = 0
    try:
        for layer in getattr(cache, "layers", []):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    except Exception:
        return 0
    return total
