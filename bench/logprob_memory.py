"""Memory and time of the output layer and the log-prob/entropy pass over one micro-batch:
rl's two ways (engine/algorithms/logprobs.py) beside the plain one.

- plain: ``logits = hidden @ W.T``, then ``log_softmax(logits.float())``, gather, entropy from the
  same log-softmax (what rl did before 2026-12-07 and what a plain HF loop does);
- chunked: the same logits, then ``position_log_probs`` (the default: keeps only the logits, in
  their dtype, and works in fp32 on ``--chunk`` positions at a time);
- fused: ``linear_log_probs(hidden, W)`` (``engine.fused_lm_head``): no [tokens, vocab] tensor at all.

Each variant runs in its own process (a fresh peak): the hidden states [tokens, H] and the output
layer's weight [V, H] are leaves that require grad (their gradient buffers made up front), then
forward + backward of a loss with a log-prob term and an entropy bonus. Reported per variant: the
bytes autograd saves for backward besides the inputs (``saved_tensors_hooks``), the peak above the
inputs and their gradients (CPU: the process's resident-set high-water mark, reset through
/proc/self/clear_refs; CUDA: the allocator's peak), and the median wall time of forward + backward.

    python bench/logprob_memory.py                       # 4096 x 49152 (SmolLM2's vocab), bf16 and fp32
    python bench/logprob_memory.py --tokens 2048 --vocab 151936 --hidden 896 --json out.json
    python bench/logprob_memory.py --device cuda --tokens 16384 --vocab 151936 --hidden 896   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset the resident-set high-water mark to the current RSS (Linux clear_refs "5"); bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak() -> int:
    return _status_kib("VmHWM") * 1024


def _plain(hidden, weight, ids, temperature: float, chunk: int):
    import torch

    z = (hidden @ weight.t()).float()
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    lp = logp_all.gather(-1, ids[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def _chunked(hidden, weight, ids, temperature: float, chunk: int):
    from engine.algorithms.logprobs import position_log_probs

    return position_log_probs(hidden @ weight.t(), ids, temperature, with_entropy=True, chunk_tokens=chunk)


def _fused(hidden, weight, ids, temperature: float, chunk: int):
    from engine.algorithms.logprobs import linear_log_probs

    return linear_log_probs(hidden, weight, ids, temperature, with_entropy=True, chunk_tokens=chunk)


VARIANTS = {"plain": _plain, "chunked": _chunked, "fused": _fused}


def worker(variant: str, tokens: int, vocab: int, hidden_size: int, dtype: str, chunk: int, repeats: int,
           device: str) -> dict:
    import torch

    torch.manual_seed(0)
    dev, dt = torch.device(device), getattr(torch, dtype)
    hidden = torch.randn(tokens, hidden_size, device=dev).to(dt).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=dev) * hidden_size ** -0.5).to(dt).requires_grad_()
    ids = torch.randint(0, vocab, (tokens,), device=dev)
    w = torch.randn(tokens, device=dev)
    cuda = dev.type == "cuda"
    fn = lambda: VARIANTS[variant](hidden, weight, ids, 0.9, chunk)  # noqa: E731
    saved: dict = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = fn()
    del lp, ent
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)  # in every variant
    if cuda:  # the allocator's own peak
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _reset_peak()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lp, ent = fn()
        ((lp * w).sum() + 0.01 * ent.sum()).backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del lp, ent
    peak = torch.cuda.max_memory_allocated() if cuda else _peak()
    times.sort()
    inputs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    return {"variant": variant, "dtype": dtype, "device": device, "tokens": tokens, "vocab": vocab,
            "hidden_size": hidden_size, "chunk": chunk, "logits_bytes": tokens * vocab * hidden.element_size(),
            "saved_bytes": sum(n for ptr, n in saved.items() if ptr not in inputs),
            "peak_above_inputs_bytes": peak - base, "fwd_bwd_s": times[len(times) // 2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (the allocator's peak)")
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "DTYPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.tokens, a.vocab, a.hidden, a.worker[1], a.chunk, a.repeats, a.device)))
        return 0
    rows = []
    for dtype in a.dtypes:
        for variant in a.variants:
            cmd = [sys.executable, __file__, "--worker", variant, dtype, "--tokens", str(a.tokens), "--vocab",
                   str(a.vocab), "--hidden", str(a.hidden), "--chunk", str(a.chunk), "--repeats", str(a.repeats), "--device", a.device]
            out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                 check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    gib = 1 << 30
    print(f"{'dtype':9} {'variant':8} {'logits':>8} {'saved':>8} {'peak+':>8} {'fwd+bwd':>8}   "
          f"({a.tokens} tokens x {a.vocab} vocab, hidden {a.hidden}, chunk {a.chunk})")
    for r in rows:
        print(f"{r['dtype']:9} {r['variant']:8} {r['logits_bytes'] / gib:7.2f}G {r['saved_bytes'] / gib:7.2f}G "
              f"{r['peak_above_inputs_bytes'] / gib:7.2f}G {r['fwd_bwd_s']:7.2f}s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
