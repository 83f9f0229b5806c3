"""Batched sampling with a KV cache on any HF-style causal LM (the built-in rollout).

Prompts are left-padded for generation (positions start at 0 at each prompt's first real
token), then rows are re-laid right-padded as prompt+response for training, with the
sampler's per-token log-probs at response positions.

What keeps it fast (``fast=True``, the default; ``fast=False`` is the plain loop, kept as the
reference the tests and ``bench/train_throughput.py --plain`` compare against):

- one prefill per distinct prompt: the ``n`` samples of a prompt share its prompt KV cache,
  which is copied ``n`` times after the prefill (``n``x less prefill compute);
- the prefill computes logits for the last position only (``logits_to_keep=1``);
- decode cost follows live tokens: rows that produced EOS leave the batch (their KV cache rows,
  mask and positions are dropped), so later steps compute only on rows still generating;
- sampling stays on the model's device: on an accelerator a device generator is seeded once per
  call from the rank's CPU generator, so no token makes a host round trip.

Routing records (``record_routing=True``, algorithm.router_replay=record|replay on a
mixture-of-experts model): every forward runs inside the model's RouterReplay.recording()
(engine/moe/router_replay.py); the prefill's choices give each row its prompt tokens' records,
each decode step's give the token it fed, and the batch carries them as ``routed_experts``
[B, T, L, k] int16. A response's last token is never fed back (generation stops after sampling
it), so it has no record; nor does padding.

Log-probs are always those of the unmodified sampling distribution (``log_softmax(logits / T)``),
so they equal what the trainer computes on the same tokens; ``rollout.ignore_eos`` only forbids
EOS when sampling (fixed-length responses, like HF ``min_new_tokens`` / vLLM ``min_tokens``).
"""

from __future__ import annotations

import torch

from engine.batch import SequenceBatch
from engine.config.schema import RolloutConfig
from engine.moe.routing_records import NO_RECORD, ROUTING_DTYPE, empty_records
from engine.rollout.base import Sampler
from engine.rollout.static_decode import StaticDecode


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (rows need not sum to 1), by inverse transform:
    one uniform draw per row placed on the row's cumulative sum. The same distribution as
    ``torch.multinomial(probs, 1)``, which on a CPU draws an exponential for every vocabulary
    entry (~0.65 ms of a 64 x 512 decode step, 1-2 us here). A token of probability 0 is never
    chosen: its interval of the cumulative sum is empty."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # below the total, even rounded
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)  # the first entry whose cumulative sum exceeds x


class TorchSampler(Sampler):
    def __init__(self, cfg: RolloutConfig, pad_token_id: int, eos_token_id: int, device: torch.device,
                 fast: bool = True, record_routing: bool = False, static_cache: bool = True):
        self.cfg = cfg
        self.static_cache = static_cache  # decode on a preallocated cache where supported (fast only)
        self.record_routing = record_routing
        self.pad = pad_token_id
        self.eos = eos_token_id
        self.device = device
        self.fast = fast
        self.last_kv_cache_bytes = 0

    @torch.no_grad()
    def generate(self, model, prompts: list[list[int]], n: int, generator: torch.Generator,
                 greedy: bool = False) -> SequenceBatch:
        rows = [p for p in prompts for _ in range(n)]
        chunk = self.cfg.micro_batch_size or len(rows)
        if self.fast and chunk >= n:  # whole prompt groups per chunk, so groups share their prefill
            chunk -= chunk % n
        gen = _device_generator(generator, self.device) if self.fast else generator
        self.last_kv_cache_bytes = 0
        with _recording(model, self.record_routing) as recorder:
            parts = [self._generate_chunk(model, rows[i:i + chunk], generator, gen, greedy, recorder)
                     for i in range(0, len(rows), chunk)]
        return SequenceBatch.concat(parts, self.pad) if len(parts) > 1 else parts[0]

    # ---- one chunk of rows ----------------------------------------------------------------
    def _generate_chunk(self, model, rows: list[list[int]], generator, dev_gen, greedy: bool,
                        recorder=None) -> SequenceBatch:
        dev, B = self.device, len(rows)
        # distinct prompts (consecutive runs of the same prompt) and, per row, its prompt
        if self.fast:
            uniq, owner = [], []
            for r in rows:
                if not uniq or uniq[-1] != r:
                    uniq.append(r)
                owner.append(len(uniq) - 1)
        else:
            uniq, owner = rows, list(range(B))
        P = max(len(r) for r in uniq)
        ids = torch.full((len(uniq), P), self.pad, dtype=torch.long)
        attn = torch.zeros((len(uniq), P), dtype=torch.long)
        for i, r in enumerate(uniq):
            ids[i, P - len(r):] = torch.tensor(r)
            attn[i, P - len(r):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        temp = max(self.cfg.temperature, 1e-6)
        keep = {"logits_to_keep": 1} if self.fast and _accepts(model, "logits_to_keep") else {}
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **keep)
        cache, logits = _returned_cache(out), out.logits[:, -1, :].float()
        prompt_rec = resp_rec = None
        if recorder is not None:  # [u, P, L, k]: the prompt tokens' routing; responses' filled per step
            # int16 on the device as well (the records' own dtype; 1/4 of the router's int64)
            prompt_rec = recorder.take(as_records=False).to(ROUTING_DTYPE).reshape(
                len(uniq), P, recorder.layout.layers, -1)
            resp_rec = torch.full((B, self.cfg.max_new_tokens) + tuple(prompt_rec.shape[2:]), NO_RECORD,
                                  dtype=ROUTING_DTYPE, device=dev)
        if len(uniq) != B:  # share the prompt's KV cache with its samples
            expand = torch.tensor(owner, device=dev)
            cache.batch_select_indices(expand)
            logits, attn, pos = logits[expand], attn[expand], pos[expand]
        next_pos = pos[:, -1:] + 1
        # decode steps on a preallocated cache where the architecture allows (static_decode.py)
        static = StaticDecode.start(model, cache, attn, self.cfg.max_new_tokens) \
            if self.fast and self.static_cache and recorder is None else None
        live = torch.arange(B, device=dev)                      # original row of each current row
        tokens = torch.full((B, self.cfg.max_new_tokens), self.pad, dtype=torch.long, device=dev)
        logps = torch.zeros((B, self.cfg.max_new_tokens), device=dev)
        lengths = torch.full((B,), self.cfg.max_new_tokens, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)     # plain path: rows that already ended
        kwarg = _cache_kwarg(model)
        steps = 0
        for t in range(self.cfg.max_new_tokens):
            steps = t + 1
            scaled = logits / temp
            logp = torch.log_softmax(scaled, dim=-1)
            if self.cfg.ignore_eos:
                scaled = scaled.index_fill(-1, torch.tensor([self.eos], device=dev), float("-inf"))
                logits = logits.index_fill(-1, torch.tensor([self.eos], device=dev), float("-inf"))
            if greedy:
                tok = logits.argmax(-1)
            else:
                probs = _top_p_filter(scaled, self.cfg.top_p).softmax(-1)
                if self.fast:
                    tok = sample_inverse_cdf(probs, dev_gen)
                else:
                    tok = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(dev)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            if not self.fast:
                tok = torch.where(done, torch.full_like(tok, self.pad), tok)
                tok_lp = torch.where(done, torch.zeros_like(tok_lp), tok_lp)
            tokens[live, t] = tok
            logps[live, t] = tok_lp
            ended = tok == self.eos
            if self.fast:
                lengths[live[ended]] = t + 1
                if t + 1 == self.cfg.max_new_tokens:
                    break
                if bool(ended.any()):  # finished rows leave the batch
                    keep_rows = (~ended).nonzero().squeeze(-1)
                    if keep_rows.numel() == 0:
                        break
                    live, tok, next_pos = live[keep_rows], tok[keep_rows], next_pos[keep_rows]
                    attn = attn[keep_rows]
                    # the cache is largest just before finished rows leave it
                    self.last_kv_cache_bytes = max(self.last_kv_cache_bytes, _cache_bytes(cache, static))
                    if static is not None:
                        static.select(keep_rows)
                    else:
                        cache.batch_select_indices(keep_rows)
                if static is not None:
                    logits = static.step(tok, next_pos).float()
                    next_pos = next_pos + 1
                    continue
                attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            else:
                newly = ended & ~done
                lengths[newly] = t + 1
                done = done | ended
                if bool(done.all()) or t + 1 == self.cfg.max_new_tokens:
                    break
                attn = torch.cat([attn, (~done | ended).long()[:, None]], dim=1)
                attn[:, -1] = 1  # the token just sampled is visible to the next step
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                        use_cache=True, **{kwarg: cache})
            cache, logits = _returned_cache(out), out.logits[:, -1, :].float()
            if recorder is not None:  # the routing of response token t, fed in this forward
                resp_rec[live, t] = recorder.take(as_records=False).to(ROUTING_DTYPE)
            next_pos = next_pos + 1
        self.last_kv_cache_bytes = max(self.last_kv_cache_bytes, _cache_bytes(cache, static))
        lengths = lengths.clamp(max=steps)
        routing = None
        if recorder is not None:
            routing = (prompt_rec.cpu(), [P - len(r) for r in uniq], owner, resp_rec[:, :steps].cpu())
        return self._to_right_padded(rows, tokens[:, :steps].cpu(), logps[:, :steps].cpu(), lengths.cpu(),
                                     routing=routing)

    def _to_right_padded(self, rows, resp, resp_lp, lens_r, routing=None) -> SequenceBatch:
        """``routing``: (prompt records [u, P, L, k] left-padded, left pad of each distinct prompt,
        distinct prompt of each row, response records [B, steps, L, k]) or None."""
        B = len(rows)
        plen = torch.tensor([len(r) for r in rows])
        T = int((plen + lens_r).max())
        input_ids = torch.full((B, T), self.pad, dtype=torch.long)
        col = torch.arange(T)[None, :]
        attn = (col < (plen + lens_r)[:, None]).long()
        rmask = ((col >= plen[:, None]) & (attn > 0)).float()
        lp = torch.zeros((B, T), dtype=torch.float32)
        for i, r in enumerate(rows):
            p, n = len(r), int(lens_r[i])
            input_ids[i, :p] = torch.tensor(r)
            input_ids[i, p:p + n] = resp[i, :n]
            lp[i, p:p + n] = resp_lp[i, :n]
        routed = None
        if routing is not None:
            prompt_rec, left_pad, owner, resp_rec = routing
            routed = empty_records((B, T), prompt_rec.shape[2], prompt_rec.shape[3])
            for i, r in enumerate(rows):
                p, n, o = len(r), int(lens_r[i]), owner[i]
                routed[i, :p] = prompt_rec[o, left_pad[o]:]
                routed[i, p:p + n] = resp_rec[i, :n]
        return SequenceBatch(input_ids=input_ids, attention_mask=attn, response_mask=rmask,
                             prompt_lengths=plen, rollout_log_probs=lp, routed_experts=routed)


def _recording(model, on: bool):
    """The model's RouterReplay.recording() context (a null context when not recording)."""
    from contextlib import nullcontext

    if not on:
        return nullcontext(None)
    from engine.moe.router_replay import attach

    return attach(model).recording()


def _device_generator(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from the rank's CPU generator (the CPU one itself on CPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def _accepts(model, name: str) -> bool:
    import inspect

    fwd = getattr(model, "forward", model)
    try:
        return name in inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x renamed past_key_values to cache; accept both."""
    return "cache" if _accepts(model, "cache") else "past_key_values"


def _returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _cache_bytes(cache, static: StaticDecode | None = None) -> int:
    """Bytes of the KV cache decoding uses now: the static one when it runs, else ``cache``."""
    if static is not None:
        return static.cache_bytes()
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
