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
- decode steps on a preallocated KV cache where the architecture allows
  (engine/rollout/static_decode.py);
- decode lanes (``rollout.decode_lanes``; auto = the rank's threads, on a CPU): the rows are
  split into lanes of whole prompt groups, each decoded on its own thread with one intra-op
  thread. A one-token step is many small ops; on a CPU, an op run on two threads pays a thread
  wake-up (~45 us with the passive OpenMP waits rl uses) that is as long as the op itself, so two
  lanes of one thread each decode faster than one lane of two threads (torch releases the GIL
  inside every op, so the lanes' ops overlap);
- the sampling noise is drawn up front, one uniform per row and step from the rank's generator,
  so what is sampled does not depend on the lanes, the chunking or when rows leave the batch;
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

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.batch import SequenceBatch
from engine.config.schema import RolloutConfig
from engine.model.hf_cache import accepts, cache_kwarg, returned_cache
from engine.moe.routing_records import NO_RECORD, ROUTING_DTYPE, empty_records
from engine.rollout.base import Sampler
from engine.rollout.static_decode import StaticDecode


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = row_cumsum(probs) - probs > top_p  # keep the smallest prefix with mass >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` over [B, V], the same bits run to run. For a single row CUDA's cumsum is one
    scan over the whole tensor (cub's, whose adding order depends on timing: pytorch#75240); two
    rows take the per-row scan, which is deterministic. On a CPU both are the sequential sum."""
    if x.shape[0] == 1 and x.is_cuda:
        return x.expand(2, -1).cumsum(-1)[:1]
    return x.cumsum(-1)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (rows need not sum to 1), by inverse transform:
    the row's uniform draw (``uniforms`` [B] in [0, 1)) placed on the row's cumulative sum. The
    same distribution as ``torch.multinomial(probs, 1)``, which on a CPU draws an exponential for
    every vocabulary entry (~0.65 ms of a 64 x 512 decode step, 1-2 us here). A token of
    probability 0 is never chosen: its interval of the cumulative sum is empty."""
    cdf = row_cumsum(probs)
    total = cdf[:, -1:]
    x = torch.minimum(uniforms.reshape(-1, 1).to(cdf.dtype) * total,
                      torch.nextafter(total, torch.zeros_like(total)))  # below the total, even rounded
    # the first entry whose cumulative sum exceeds x; clamped: nan probabilities (weights that diverged)
    # give a token the update's nan loss then reports (engine/algorithms/alarms.py), not an IndexError
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class _ModelSteps:
    """Decode steps through the model's own forward and its growing cache (any architecture;
    the fallback of engine/rollout/static_decode.py), recording MoE routing when asked."""

    def __init__(self, model, cache, attn: torch.Tensor, positions: torch.Tensor,
                 recorder=None, resp_rec: torch.Tensor | None = None):
        self.model, self.cache, self.attn, self.positions = model, cache, attn, positions
        self.kwarg = cache_kwarg(model)
        self.recorder, self.resp_rec = recorder, resp_rec
        self.live = torch.arange(attn.shape[0], device=attn.device)
        self.t = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attn, position_ids=self.positions,
                         use_cache=True, **{self.kwarg: self.cache})
        self.cache = returned_cache(out)
        if self.recorder is not None:  # the routing of response token t, fed in this forward
            self.resp_rec[self.live, self.t] = self.recorder.take(as_records=False).to(ROUTING_DTYPE)
        self.positions = self.positions + 1
        self.t += 1
        return out.logits[:, -1, :]

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attn, self.positions, self.live = self.attn[rows], self.positions[rows], self.live[rows]

    def cache_bytes(self) -> int:
        return _cache_bytes(self.cache)


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
        self.last_lanes = 1
        # decode with static shapes (engine/rollout/graphed_decode.py): captured as CUDA graphs on a
        # GPU (rollout.cuda_graphs); on a CPU the same steps run eagerly (what the tests compare)
        self.static_shapes = bool(getattr(cfg, "cuda_graphs", False))

    def _eos(self, dev) -> torch.Tensor:
        return torch.tensor([self.eos, *self.end_token_ids], device=dev)

    def _stops(self, dev) -> torch.Tensor:
        return torch.tensor([self.eos, *self.end_token_ids, *self.stop_token_ids], device=dev)

    def generate(self, model, prompts: list[list[int]], n: int, generator: torch.Generator,
                 greedy: bool = False) -> SequenceBatch:
        parts = [piece for _, piece in self.generate_pieces(model, prompts, n, generator, greedy)]
        return SequenceBatch.concat(parts, self.pad) if len(parts) > 1 else parts[0]

    def generate_pieces(self, model, prompts: list[list[int]], n: int, generator: torch.Generator,
                        greedy: bool = False, stream: bool = False):
        """``generate``'s rows as ``(first row, SequenceBatch)`` pieces: each chunk of
        rollout.micro_batch_size rows, in order; with ``stream`` (trainer.stream_groups) each prompt
        group as soon as all its samples have ended, in the order they end, while the other rows
        decode. Sorted by first row and concatenated, the pieces are exactly ``generate``'s batch."""
        rows = [p for p in prompts for _ in range(n)]
        chunk = self.cfg.micro_batch_size or len(rows)
        if self.fast and chunk >= n:  # whole prompt groups per chunk, so groups share their prefill
            chunk -= chunk % n
        # the fast path's sampling noise: one uniform per row and step, drawn here in row order from
        # the rank's CPU generator and copied over once: the same draws on any device (a CUDA
        # generator's assignment of numbers to elements depends on the GPU's SM count)
        noise = None if greedy or not self.fast else torch.rand(
            (len(rows), self.cfg.max_new_tokens), generator=generator).to(self.device)
        self.last_kv_cache_bytes = 0
        self.last_lanes = 1
        with _recording(model, self.record_routing) as recorder:
            for i in range(0, len(rows), chunk):
                if not self.fast:
                    with torch.no_grad():
                        yield i, self._generate_chunk(model, rows[i:i + chunk], generator, greedy, recorder)
                    continue
                # grad mode is set around each step of the chunk's generator, never across a yield
                pieces = self._generate_fast_chunk(model, rows[i:i + chunk], noise[i:i + chunk]
                                                   if noise is not None else None, recorder, n if stream else 0)
                while True:
                    with torch.no_grad():
                        item = next(pieces, None)
                    if item is None:
                        break
                    yield i + item[0], item[1]

    # ---- the fast path ------------------------------------------------------------------------
    def _generate_fast_chunk(self, model, rows: list[list[int]], noise: torch.Tensor | None,
                             recorder=None, stream: int = 0):
        """One chunk of rows: one prefill per distinct prompt, then decode lanes (or one). Yields
        ``(first row, SequenceBatch)``: the whole chunk, or with ``stream`` = n each group of n rows
        (one prompt's samples) as it ends (the eager decode; CUDA-graph decoding and routing
        records yield the whole chunk)."""
        dev, B = self.device, len(rows)
        uniq, owner = [], []
        for r in rows:  # distinct prompts (consecutive runs of the same prompt) and, per row, its prompt
            if not uniq or uniq[-1] != r:
                uniq.append(r)
            owner.append(len(uniq) - 1)
        ids, attn, pos = self._left_padded(uniq)
        P = ids.shape[1]
        keep = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **keep)
        cache, logits = returned_cache(out), out.logits[:, -1, :].float()
        del out  # it holds the prefill's cache too: the decode copies what it needs, or keeps `cache`
        expand = torch.tensor(owner, device=dev)
        logits, attn, next_pos = logits[expand], attn[expand], pos[expand][:, -1:] + 1
        N = self.cfg.max_new_tokens
        if recorder is not None:  # [u, P, L, k]: the prompt tokens' routing; responses' filled per step
            # int16 on the device as well (the records' own dtype; 1/4 of the router's int64)
            prompt_rec = recorder.take(as_records=False).to(ROUTING_DTYPE).reshape(
                len(uniq), P, recorder.layout.layers, -1)
            resp_rec = torch.full((B, N) + tuple(prompt_rec.shape[2:]), NO_RECORD, dtype=ROUTING_DTYPE, device=dev)
        decoders = None
        if self.static_cache and recorder is None:  # a preallocated cache per lane, one set of fused weights
            lanes, decoders = self._lanes(owner), []
            for lane in lanes:
                rows_dev = lane.to(dev)
                decoders.append(StaticDecode.start(model, cache, attn[rows_dev], N, rows=expand[rows_dev],
                                                   positions=next_pos[rows_dev],
                                                   like=decoders[0] if decoders else None))
                if decoders[-1] is None:  # not this architecture: the fallback below
                    decoders = None
                    break
        if decoders is None:  # the model's own forward decodes (one lane)
            if len(uniq) != B:
                cache.batch_select_indices(expand)  # every sample gets its prompt's keys/values
            lanes = [torch.arange(B)]
            decoders = [_ModelSteps(model, cache, attn, next_pos, recorder,
                                    resp_rec if recorder is not None else None)]
        del cache
        jobs = [(decoders[j], logits[lane.to(dev)], None if noise is None else noise[lane.to(dev)])
                for j, lane in enumerate(lanes)]
        decode = self._decode_static if self.static_shapes else self._decode
        streamed = stream > 0 and not self.static_shapes and recorder is None
        groups = [(g, min(g + stream, B)) for g in range(0, B, stream)] if streamed else []
        emitted: set[int] = set()
        if streamed:
            stream_out: list = []
            for item in self._decode_streaming(jobs, lanes, groups, stream_out):
                g, tok, lp, ln = item
                emitted.add(g)
                s0, s1 = groups[g]
                yield s0, self._to_right_padded(rows[s0:s1], tok, lp, ln)
            results = stream_out
        elif len(jobs) == 1:
            results = [decode(*jobs[0])]
        else:
            results = _run_lanes(decode, jobs, self.device)
        self.last_lanes = max(self.last_lanes, len(jobs))
        tokens = torch.full((B, N), self.pad, dtype=torch.long)
        logps = torch.zeros((B, N))
        lengths = torch.zeros(B, dtype=torch.long)
        steps = 0
        for lane, (tok, lp, ln, st, cache_bytes) in zip(lanes, results):
            tokens[lane], logps[lane], lengths[lane] = tok.cpu(), lp.cpu(), ln.cpu()
            steps = max(steps, st)
        self.last_kv_cache_bytes = max(self.last_kv_cache_bytes, sum(r[4] for r in results))
        routing = None
        if recorder is not None:
            routing = (prompt_rec.cpu(), [P - len(r) for r in uniq], owner, resp_rec[:, :steps].cpu())
        if not streamed:
            yield 0, self._to_right_padded(rows, tokens[:, :steps], logps[:, :steps], lengths.clamp(max=steps),
                                           routing=routing)
            return
        for g, (s0, s1) in enumerate(groups):  # the groups still decoding when the lanes stopped
            if g not in emitted:
                ln = lengths[s0:s1].clamp(max=steps)
                w = int(ln.max())
                yield s0, self._to_right_padded(rows[s0:s1], tokens[s0:s1, :w], logps[s0:s1, :w], ln)

    def _decode_streaming(self, jobs: list, lanes: list, groups: list, results: list):
        """The lanes decoding on the lane pool while this thread yields ``(group, tokens, log-probs,
        lengths)`` for each prompt group whose samples have all ended; ``results`` then receives
        each lane's ``_decode`` result (for the groups still live at the last step)."""
        import queue

        ended: queue.SimpleQueue = queue.SimpleQueue()
        threads = torch.get_num_threads()
        group_of = {r: g for g, (s0, s1) in enumerate(groups) for r in range(s0, s1)}
        left = [s1 - s0 for s0, s1 in groups]
        done: dict[int, tuple] = {}

        device = lane_device(self.device)

        def lane(j, job):
            torch.set_num_threads(1 if len(jobs) > 1 else threads)  # as _run_lanes; one lane keeps them all
            with torch.no_grad(), on_device(device):
                return self._decode(*job, on_ended=lambda r, t, lp, n: ended.put((j, r, t, lp, n)))

        futures = [_lane_pool(len(jobs)).submit(lane, j, job) for j, job in enumerate(jobs)]
        try:
            while True:
                try:
                    j, local, tok, lp, n = ended.get(timeout=0.01)
                except queue.Empty:
                    if all(f.done() for f in futures) and ended.empty():
                        break
                    continue
                for k, li in enumerate(local.tolist()):
                    row = int(lanes[j][li])
                    done[row] = (tok[k], lp[k], n)
                    g = group_of[row]
                    left[g] -= 1
                    if left[g] == 0:
                        s0, s1 = groups[g]
                        w = max(done[r][2] for r in range(s0, s1))
                        t = torch.full((s1 - s0, w), self.pad, dtype=torch.long)
                        p = torch.zeros((s1 - s0, w))
                        for i, r in enumerate(range(s0, s1)):
                            t[i, :done[r][2]], p[i, :done[r][2]] = done[r][0], done[r][1]
                        yield g, t, p, torch.tensor([done[r][2] for r in range(s0, s1)])
        finally:
            results.extend(f.result() for f in futures)  # a lane's error surfaces here
            torch.set_num_threads(threads)

    def _lanes(self, owner: list[int]) -> list[torch.Tensor]:
        """Rows of each decode lane: whole prompt groups, as even as the groups allow."""
        if getattr(self.cfg, "cuda_graphs", False) and torch.device(self.device).type == "cuda":
            want = 1  # one CUDA-graph capture at a time in a process: lanes would capture together
        else:
            want = self.cfg.decode_lanes or (torch.get_num_threads() if torch.device(self.device).type == "cpu" else 1)
        groups: list[list[int]] = []
        for i, o in enumerate(owner):
            if not groups or owner[groups[-1][0]] != o:
                groups.append([])
            groups[-1].append(i)
        k = max(1, min(want, len(groups)))
        lanes: list[list[int]] = []
        cur: list[int] = []
        remaining = len(owner)
        for gi, g in enumerate(groups):  # contiguous, each lane near its share of the rows left
            left = k - len(lanes)         # lanes still to fill, the current one included
            target = remaining / left
            must = len(groups) - gi == left - 1  # one group left for each lane after this one
            if cur and left > 1 and (must or len(cur) + len(g) - target > target - len(cur)):
                lanes.append(cur)
                remaining -= len(cur)
                cur = []
            cur = cur + g
        lanes.append(cur)
        return [torch.tensor(x, dtype=torch.long) for x in lanes if x]

    def _decode(self, steps, logits: torch.Tensor, noise: torch.Tensor | None, on_ended=None):
        """Sample every token of these rows; ``steps`` feeds a token and returns the next logits
        (StaticDecode or _ModelSteps). Returns (tokens [b, N], log-probs [b, N], lengths [b],
        steps taken, largest KV cache bytes). ``on_ended(rows, tokens, log-probs, length)``: called
        (on this thread) with the rows that just ended and their final tokens (trainer.stream_groups)."""
        dev, N = logits.device, self.cfg.max_new_tokens
        b = logits.shape[0]
        tokens = torch.full((b, N), self.pad, dtype=torch.long, device=dev)
        logps = torch.zeros((b, N), device=dev)
        lengths = torch.full((b,), N, dtype=torch.long, device=dev)
        live = None  # original row of each current row; None while every row is live
        eos = self._eos(dev)
        stops = self._stops(dev)
        cache_bytes, taken = 0, 0
        for t in range(N):
            taken = t + 1
            u = None if noise is None else (noise[:, t] if live is None else noise[live, t])
            tok, tok_lp = self._sample(logits.float(), u, eos)
            if live is None:
                tokens[:, t], logps[:, t] = tok, tok_lp
            else:
                tokens[live, t], logps[live, t] = tok, tok_lp
            if t + 1 == N:
                break
            if not self.cfg.ignore_eos:
                ended = torch.isin(tok, stops)
                if bool(ended.any()):  # finished rows leave the batch
                    rows_now = torch.arange(b, device=dev) if live is None else live
                    lengths[rows_now[ended]] = t + 1
                    if on_ended is not None:
                        done = rows_now[ended]
                        on_ended(done.cpu(), tokens[done, :t + 1].cpu(), logps[done, :t + 1].cpu(), t + 1)
                    keep_rows = (~ended).nonzero().squeeze(-1)
                    if keep_rows.numel() == 0:
                        break
                    cache_bytes = max(cache_bytes, steps.cache_bytes())  # largest just before rows leave
                    live, tok = rows_now[keep_rows], tok[keep_rows]
                    steps.select(keep_rows)
            logits = steps.step(tok)
        cache_bytes = max(cache_bytes, steps.cache_bytes())
        return tokens, logps, lengths, taken, cache_bytes

    def _decode_static(self, steps, logits: torch.Tensor, noise: torch.Tensor | None):
        """``_decode`` with every step's shapes fixed (engine/rollout/graphed_decode.py), captured as
        CUDA graphs on a GPU; the model's own forward (no static cache) decodes as ``_decode``."""
        if not isinstance(steps, StaticDecode) or not steps.make_static():
            return self._decode(steps, logits, noise)
        from engine.rollout.graphed_decode import decode_graphed

        eos = self._eos(logits.device)
        return decode_graphed(steps, lambda lg, u: self._sample(lg, u, eos), logits, noise, self.cfg.max_new_tokens,
                              self._stops(logits.device), self.pad, self.cfg.ignore_eos,
                              capture=logits.device.type == "cuda")

    def _sample(self, logits: torch.Tensor, u: torch.Tensor | None, eos: torch.Tensor):
        """A token per row (greedy when ``u`` is None) and its log-prob under the unmodified
        sampling distribution."""
        temp = max(self.cfg.temperature, 1e-6)
        scaled = logits if temp == 1.0 else logits / temp
        logp = torch.log_softmax(scaled, dim=-1)
        if u is None:
            tok = (logits.index_fill(-1, eos, float("-inf")) if self.cfg.ignore_eos else logits).argmax(-1)
        elif self.cfg.top_p < 1.0:
            masked = scaled.index_fill(-1, eos, float("-inf")) if self.cfg.ignore_eos else scaled
            tok = sample_inverse_cdf(_top_p_filter(masked, self.cfg.top_p).softmax(-1), u)
        else:
            probs = logp.exp()  # softmax(scaled); the inverse transform needs no normalisation
            if self.cfg.ignore_eos:
                probs = probs.index_fill(-1, eos, 0.0)  # not probs[:, eos] = 0: on CUDA that copies a host 0 (a sync) and breaks a graph capture
            tok = sample_inverse_cdf(probs, u)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    def _left_padded(self, prompts: list[list[int]]):
        """[u, P] ids, attention mask and positions (0 at each prompt's first real token) on the device."""
        P = max(len(r) for r in prompts)
        ids = torch.full((len(prompts), P), self.pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, r in enumerate(prompts):
            ids[i, P - len(r):] = torch.tensor(r)
            attn[i, P - len(r):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)

    # ---- the plain loop (reference) -------------------------------------------------------------
    def _generate_chunk(self, model, rows: list[list[int]], generator, greedy: bool,
                        recorder=None) -> SequenceBatch:
        """Every row prefilled, finished rows kept (masked), sampling on the host."""
        dev, B = self.device, len(rows)
        ids, attn, pos = self._left_padded(rows)
        P = ids.shape[1]
        temp = max(self.cfg.temperature, 1e-6)
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache, logits = returned_cache(out), out.logits[:, -1, :].float()
        prompt_rec = resp_rec = None
        if recorder is not None:
            prompt_rec = recorder.take(as_records=False).to(ROUTING_DTYPE).reshape(B, P, recorder.layout.layers, -1)
            resp_rec = torch.full((B, self.cfg.max_new_tokens) + tuple(prompt_rec.shape[2:]), NO_RECORD,
                                  dtype=ROUTING_DTYPE, device=dev)
        next_pos = pos[:, -1:] + 1
        tokens = torch.full((B, self.cfg.max_new_tokens), self.pad, dtype=torch.long, device=dev)
        logps = torch.zeros((B, self.cfg.max_new_tokens), device=dev)
        lengths = torch.full((B,), self.cfg.max_new_tokens, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)     # rows that already ended
        kwarg = cache_kwarg(model)
        eos = self._eos(dev)
        steps = 0
        for t in range(self.cfg.max_new_tokens):
            steps = t + 1
            scaled = logits / temp
            logp = torch.log_softmax(scaled, dim=-1)
            if self.cfg.ignore_eos:
                scaled = scaled.index_fill(-1, eos, float("-inf"))
                logits = logits.index_fill(-1, eos, float("-inf"))
            if greedy:
                tok = logits.argmax(-1)
            else:
                probs = _top_p_filter(scaled, self.cfg.top_p).softmax(-1)
                tok = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(dev)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            tok = torch.where(done, torch.full_like(tok, self.pad), tok)
            tok_lp = torch.where(done, torch.zeros_like(tok_lp), tok_lp)
            tokens[:, t] = tok
            logps[:, t] = tok_lp
            ended = torch.isin(tok, self._stops(dev))
            newly = ended & ~done
            lengths[newly] = t + 1
            done = done | ended
            if bool(done.all()) or t + 1 == self.cfg.max_new_tokens:
                break
            attn = torch.cat([attn, (~done | ended).long()[:, None]], dim=1)
            attn[:, -1] = 1  # the token just sampled is visible to the next step
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                        use_cache=True, **{kwarg: cache})
            cache, logits = returned_cache(out), out.logits[:, -1, :].float()
            if recorder is not None:
                resp_rec[:, t] = recorder.take(as_records=False).to(ROUTING_DTYPE)
            next_pos = next_pos + 1
        self.last_kv_cache_bytes = max(self.last_kv_cache_bytes, _cache_bytes(cache))
        lengths = lengths.clamp(max=steps)
        routing = None
        if recorder is not None:
            routing = (prompt_rec.cpu(), [P - len(r) for r in rows], list(range(B)), resp_rec[:, :steps].cpu())
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


def _run_lanes(decode, jobs: list, device) -> list:
    """``decode(*job)`` for every job at once, one thread each with one intra-op thread (CPU).
    torch releases the GIL inside each op, so the lanes' ops run side by side; grad mode and the
    current CUDA device are per thread, so each lane sets them itself. The caller's thread count
    is restored."""
    threads = torch.get_num_threads()
    device = lane_device(device)

    def lane(job):
        torch.set_num_threads(1)
        with torch.no_grad(), on_device(device):
            return decode(*job)

    try:
        return list(_lane_pool(len(jobs)).map(lane, jobs))
    finally:
        torch.set_num_threads(threads)


def lane_device(device) -> torch.device:
    """The rollout's device with its index, resolved in the calling thread (a bare ``cuda`` is the
    caller's current device; a lane thread would read its own, always 0)."""
    d = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def on_device(device):
    """A lane thread's current CUDA device set to ``device`` (from ``lane_device``), for the lane's
    life: each thread starts on device 0, where a stream or a tensor made without an index would go
    (a rank on ``cuda:N`` with every GPU visible). Nothing to do on a CPU."""
    d = torch.device(device)
    return torch.cuda.device(d) if d.type == "cuda" else contextlib.nullcontext()


_LANES: dict = {}  # the process's decode-lane pool, kept between rollouts: {"size": n, "pool": executor}


def _lane_pool(lanes: int) -> ThreadPoolExecutor:
    """A pool of at least ``lanes`` threads, made once and reused: a pool per rollout started and
    joined two threads every step (thread churn a soak's thread count sampled as noise)."""
    if _LANES.get("size", 0) < lanes:
        if _LANES:
            _LANES["pool"].shutdown(wait=False)
        _LANES.update(size=lanes, pool=ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="rl-decode-lane"))
    return _LANES["pool"]


def _recording(model, on: bool):
    """The model's RouterReplay.recording() context (a null context when not recording)."""
    from contextlib import nullcontext

    if not on:
        return nullcontext(None)
    from engine.moe.router_replay import attach

    return attach(model).recording()


def _cache_bytes(cache) -> int:
    """Bytes of transformers' KV cache ``cache``."""
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
