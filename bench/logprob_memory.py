"""Memory and time of the log-prob/entropy pass over one micro-batch's logits: rl's chunked
function (engine/algorithms/logprobs.py) beside the plain way (``log_softmax(logits.float())``,
gather, entropy from the same log-softmax: what rl did before and what a plain HF loop does).

Each variant runs in its own process (a fresh peak): logits [tokens, vocab] are made as a leaf
that requires grad (standing in for the lm_head output), then forward + backward of a loss with
a log-prob term and an entropy bonus. Reported per variant: the bytes autograd saves for backward
(``saved_tensors_hooks``), the process's peak RSS above its level once the logits and their gradient
exist (the high-water mark reset through /proc/self/clear_refs; big buffers are mmapped and
returned on free, so it is the allocator's peak), and the median
wall time of forward + backward.

    python bench/logprob_memory.py                       # 4096 x 49152 (SmolLM2's vocab), bf16 and fp32
    python bench/logprob_memory.py --tokens 2048 --vocab 151936 --json out.json
    python bench/logprob_memory.py --device cuda --tokens 16384 --vocab 151936   # on a GPU
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


def _plain(logits, ids, temperature: float):
    import torch

    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    lp = logp_all.gather(-1, ids[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def _chunked(logits, ids, temperature: float, chunk: int):
    from engine.algorithms.logprobs import position_log_probs

    return position_log_probs(logits, ids, temperature, with_entropy=True, chunk_tokens=chunk)


def worker(variant: str, tokens: int, vocab: int, dtype: str, chunk: int, repeats: int, device: str) -> dict:
    import torch

    torch.manual_seed(0)
    dev = torch.device(device)
    logits = (torch.randn(tokens, vocab, device=dev) * 2).to(getattr(torch, dtype)).requires_grad_()
    ids = torch.randint(0, vocab, (tokens,), device=dev)
    w = torch.randn(tokens, device=dev)
    cuda = dev.type == "cuda"
    fn = (lambda: _plain(logits, ids, 0.9)) if variant == "plain" else (lambda: _chunked(logits, ids, 0.9, chunk))
    saved: dict = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = fn()
    del lp, ent
    logits.grad = torch.zeros_like(logits)  # the gradient buffer exists in both variants
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
    return {"variant": variant, "dtype": dtype, "device": device, "tokens": tokens, "vocab": vocab, "chunk": chunk,
            "logits_bytes": logits.numel() * logits.element_size(),
            "saved_bytes": sum(saved.values()),
            "peak_above_logits_bytes": peak - base,
            "fwd_bwd_s": times[len(times) // 2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (the allocator's peak)")
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "DTYPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.tokens, a.vocab, a.worker[1], a.chunk, a.repeats, a.device)))
        return 0
    rows = []
    for dtype in a.dtypes:
        for variant in ("plain", "chunked"):
            cmd = [sys.executable, __file__, "--worker", variant, dtype, "--tokens", str(a.tokens), "--vocab",
                   str(a.vocab), "--chunk", str(a.chunk), "--repeats", str(a.repeats), "--device", a.device]
            out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                 check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    gib = 1 << 30
    print(f"{'dtype':9} {'variant':8} {'logits':>8} {'saved':>8} {'peak+':>8} {'fwd+bwd':>8}   ({a.tokens} x {a.vocab}, chunk {a.chunk})")
    for r in rows:
        print(f"{r['dtype']:9} {r['variant']:8} {r['logits_bytes'] / gib:7.2f}G {r['saved_bytes'] / gib:7.2f}G "
              f"{r['peak_above_logits_bytes'] / gib:7.2f}G {r['fwd_bwd_s']:7.2f}s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
