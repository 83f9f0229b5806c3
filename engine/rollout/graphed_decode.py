"""CUDA-graph decoding for the torch sampler (``rollout.cuda_graphs=true``; issue 41).

On a GPU a one-token decode step of a small model is hundreds of small kernels (~16 a layer), and
their launch cost on the host, not the arithmetic, bounds the rollout. Here a whole decode step --
the forward for one token per row (engine/rollout/static_decode.py in its static-shape mode) *and*
the sampling of the next token -- is captured once as a CUDA graph and replayed for every step:

- the step index lives on the device and the step advances it itself: keys and values are written
  with ``index_copy_`` at it, the mask opened with ``index_fill_``, the rotary tables and the
  rollout's sampling noise read with ``index_select``; attention covers the whole preallocated cache
  (prompt + max_new_tokens), the positions not written yet closed by the mask (exp(-inf) = 0: the
  same softmax);
- no host sync per step: rows that end stay in the batch (what they sample afterwards is dropped at
  the end) and the host looks at how many rows are still live every ``check_every`` steps only;
- batch-size buckets: once the live rows fit a smaller bucket (powers of two), the state is
  compacted into that many rows (live rows first, ended rows as filler) and that bucket's graph is
  captured -- at most log2(rows) captures a rollout, each after one eager step (the warm-up).

On a CPU nothing is captured: the same static-shape step runs eagerly, which is how the tests check
it against the sampler's dynamic path, token for token (tests/test_graphed_decode.py). **It has not
yet run on a GPU** (no device was lent to the session that wrote it): the flag stays off by default
until bench/gpu_bench.py has measured it.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.rollout.static_decode import StaticDecode

CHECK_EVERY = 8  # decode steps between the host's looks at how many rows are still live


def buckets(rows: int) -> list[int]:
    """Batch sizes a rollout of ``rows`` rows may be compacted to, largest first: ``rows`` itself,
    then the powers of two below it."""
    out, b = [rows], 1
    while b < rows:
        b *= 2
    b //= 2
    while b >= 1:
        if b < rows:
            out.append(b)
        b //= 2
    return out


def compaction(live: torch.Tensor, size: int) -> torch.Tensor:
    """Rows to keep when compacting to ``size`` rows: every live row (``live`` [B] bool) first, in
    order, then ended rows as filler."""
    order = torch.cat([live.nonzero().squeeze(-1), (~live).nonzero().squeeze(-1)])
    return order[:size]


class _Step:
    """A decode step as a callable that is either replayed from a captured CUDA graph or run eagerly."""

    def __init__(self, fn: Callable[[], None], capture: bool, pool=None):
        self.fn, self.graph = fn, None
        if capture:  # warm-up first (allocator, cuBLAS workspaces): one real step on a side stream
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                fn()  # recorded, not run

    @property
    def warmed(self) -> bool:
        """The constructor already ran one step (the warm-up before a capture)."""
        return self.graph is not None

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


def decode_graphed(decoder: StaticDecode, sample: Callable, logits: torch.Tensor, noise: torch.Tensor | None,
                   max_new_tokens: int, stops: torch.Tensor, pad: int, ignore_eos: bool, capture: bool,
                   check_every: int = CHECK_EVERY):
    """Sample every token of ``decoder``'s rows (``decoder.make_static()`` already done). ``sample
    (logits, u) -> (token, log-prob)`` is the sampler's own rule (``u`` None: greedy), ``logits``
    the prefill's last logits [b, V], ``noise`` [b, N] the rollout's uniforms. Returns what
    ``TorchSampler._decode`` returns: (tokens [b, N], log-probs [b, N], lengths [b], steps taken,
    largest KV cache bytes)."""
    dev, N, b = logits.device, max_new_tokens, logits.shape[0]
    tokens = torch.full((b, N), pad, dtype=torch.long, device=dev)
    logps = torch.zeros((b, N), device=dev)
    tok, lp = sample(logits.float(), None if noise is None else noise[:, 0])
    tokens[:, 0], logps[:, 0] = tok, lp
    cache_bytes = decoder.cache_bytes()
    rows = torch.arange(b, device=dev)             # the rollout row in each batch slot
    fed = tok.clone()                              # the token the next step feeds, per slot
    live = torch.ones(b, dtype=torch.bool, device=dev) if ignore_eos else ~torch.isin(tok, stops)
    step = torch.ones(1, dtype=torch.long, device=dev)  # the index of the token the next step samples
    slot_noise = noise
    pool = torch.cuda.graph_pool_handle() if capture else None

    def one_step():
        nxt = decoder.step(fed)
        u = None if slot_noise is None else slot_noise.index_select(1, step).squeeze(1)
        t, l = sample(nxt.float(), u)
        at = step.expand(rows.shape[0])
        tokens.index_put_((rows, at), t)
        logps.index_put_((rows, at), l)
        if not ignore_eos:
            live.logical_and_(~(t[:, None] == stops).any(-1))  # not isin: long stop lists make it sync
        fed.copy_(t)
        step.add_(1)

    runner, done, sizes = None, 1, buckets(b)
    graphs = []  # every bucket's step, alive until the decode ends: its pool is reused by the next capture
    if not ignore_eos and not bool(live.any()):  # every row ended at its first token
        done = N
    while done < N:
        if runner is None:  # a new bucket's step: a capture runs one step first (its warm-up)
            runner = _Step(one_step, capture and done + 1 < N, pool)
            graphs.append(runner)
            if runner.warmed:
                done += 1
                continue
        runner()
        done += 1
        if ignore_eos or (done % check_every and done < N):
            continue
        n_live = int(live.sum())                   # the host's look: one sync every check_every steps
        if n_live == 0:
            break
        size = min(s for s in sizes if s >= n_live)
        if size < rows.shape[0] and done < N:      # compact into the smaller bucket, capture its graph
            keep = compaction(live, size)
            decoder.select(keep)
            rows, fed, live = rows[keep], fed[keep].clone(), live[keep].clone()
            slot_noise = None if slot_noise is None else slot_noise[keep]
            runner = None
    if ignore_eos:
        lengths = torch.full((b,), N, dtype=torch.long, device=dev)
    else:  # a row ends at its first stop token; what it sampled after that is dropped
        hit = torch.isin(tokens, stops)
        lengths = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full((b,), N, device=dev))
    after = torch.arange(N, device=dev)[None, :] >= lengths[:, None]
    tokens.masked_fill_(after, pad)
    logps.masked_fill_(after, 0.0)
    return tokens, logps, lengths, int(lengths.max()), cache_bytes
