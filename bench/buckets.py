"""Length-bucket padding: pad fraction, shapes, recompiles and step time, per bucket policy.

Replays ragged RL batches (synthetic long-tailed response lengths that drift longer over the
run, as RL responses do, or lengths read from a rollout/metrics dump) through
``split_micro_batches`` and a ``torch.compile(dynamic=False)``'d tiny Llama on CPU, so every
new micro-batch shape compiles a new graph. Each policy runs the same batches twice:

  cold pass  what a run pays: compiles on first sight of a shape, then forward+backward
  warm pass  the same micro-batches again (3 times, min kept), every shape compiled: compute

and prints, for no padding / a fixed budget / multiple-of-1024 (verl's default) /
multiple-of-16 / geometric / learned: pad fraction, distinct shapes, graphs compiled (total
and in the second half of the run: does it keep recompiling?), warm and cold step time, and a
projected step time over a longer run (warm + measured compile cost x compiles projected from
the second-half rate, capped by the most shapes the policy can have), each as a ratio to
"no padding" measured in the same run.

Default backend is aot_eager (dynamo + AOTAutograd: real graph capture and recompiles, about
1 s per shape here). Inductor's C++ codegen costs ~15 s per shape on 2 cores, which would make
the no-padding baseline alone run for many minutes; pass --backend inductor to use it anyway.

    python bench/buckets.py                                   # ~5 min on a 2-core machine
    python bench/buckets.py --lengths dump.jsonl --layout padded
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, Python puts bench/ first on sys.path, where a bench module named like a
# stdlib module (bench/inspect.py) would shadow it for torch. Import from the repo root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import copy
import json
import math
import random
import statistics
import time

import torch

from engine.batch import SequenceBatch  # noqa: E402
from engine.batching.buckets import make_bucket_policy  # noqa: E402
from engine.batching.microbatch import pad_stats, split_micro_batches  # noqa: E402
from engine.config.schema import FSDPEngineConfig  # noqa: E402

VOCAB = 256
PAD = 0
# CPU seconds of this process: the bench machine is shared, and CPU time (one torch thread by
# default) is far less disturbed by other processes than wall time. --clock wall to change.
CLOCK = time.process_time


# ---- length sources ----------------------------------------------------------------------

def synthetic_lengths(steps: int, batch: int, max_prompt: int, max_new: int, seed: int) -> list[list[int]]:
    """Per step: prompt ~ U(24, max_prompt); response: 85% lognormal around a median that grows
    from 150 to ~250 tokens over the run (sigma 0.75), 10% runaway responses cut at max_new,
    5% near-empty (early EOS)."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        median = 150 * (1 + 0.7 * step / max(1, steps - 1))
        lens = []
        for _ in range(batch):
            u = rng.random()
            if u < 0.10:
                resp = max_new
            elif u < 0.15:
                resp = rng.randint(1, 8)
            else:
                resp = min(max_new, max(1, int(rng.lognormvariate(math.log(median), 0.75))))
            lens.append(rng.randint(24, max_prompt) + resp)
        out.append(lens)
    return out


def file_lengths(path: str, batch: int, steps: int) -> list[list[int]]:
    """Sequence lengths from a dump: a JSON list of ints, JSONL rows with ``seq_lengths`` /
    ``lengths`` (or ``response_lengths`` plus optional ``prompt_lengths``), or one int a line.
    Cut into steps of ``batch`` sequences, in file order."""
    text = Path(path).read_text()
    lengths: list[int] = []
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        rows = [json.loads(line) if line.strip()[:1] in "[{" else int(line)
                for line in text.splitlines() if line.strip()]
    for row in rows:
        if isinstance(row, int):
            lengths.append(row)
        elif isinstance(row, list):
            lengths += [int(x) for x in row]
        elif isinstance(row, dict):
            if "seq_lengths" in row or "lengths" in row:
                lengths += [int(x) for x in row.get("seq_lengths", row.get("lengths"))]
            elif "response_lengths" in row:
                resp = row["response_lengths"]
                prompt = row.get("prompt_lengths", [0] * len(resp))
                lengths += [int(p) + int(r) for p, r in zip(prompt, resp)]
    lengths = [n for n in lengths if n > 0]
    if len(lengths) < batch:
        raise SystemExit(f"{path}: found {len(lengths)} lengths, fewer than one batch ({batch})")
    n_steps = min(steps, len(lengths) // batch)
    return [lengths[i * batch:(i + 1) * batch] for i in range(n_steps)]


def make_batch(lengths: list[int], seed: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.full((b, t), PAD, dtype=torch.long)
    am = torch.zeros(b, t, dtype=torch.long)
    rm = torch.zeros(b, t)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        am[i, :n] = 1
        rm[i, min(n - 1, 24):n] = 1.0
    adv = torch.randn(b, t, generator=g) * am
    return SequenceBatch(ids, am, rm, am.sum(-1) * 0 + 24, advantages=adv)


# ---- model and compile counting ----------------------------------------------------------

class CompileCounter:
    """A torch.compile backend that counts graph compilations and delegates to a real backend."""

    def __init__(self, backend: str):
        self.inner = torch._dynamo.lookup_backend(backend)
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        return self.inner(gm, example_inputs)


def tiny_llama(max_pos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def fwd_bwd(model, mb, layout: str, n_resp: float) -> None:
    """Forward, per-token log-probs at target positions, masked token-mean PG loss, backward."""
    b = mb.batch
    if layout == "packed":
        p = mb.packed
        logits = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False).logits
        ids = p.input_ids
    else:
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
        ids = b.input_ids
    lp = torch.zeros(ids.shape)
    lp[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    if layout == "packed":
        lp = mb.packed.unpack(lp)
        lp = torch.cat([torch.zeros_like(lp[:, :1]), lp[:, 1:]], 1)
    loss = -(lp * b.advantages * b.response_mask).sum() / n_resp
    loss.backward()


# ---- one policy ---------------------------------------------------------------------------

def run_policy(name, cfg, max_length, steps_lengths, args, base_state):
    torch._dynamo.reset()
    counter = CompileCounter(args.backend)
    model = tiny_llama(args.max_pos)
    model.load_state_dict(base_state)
    compiled = torch.compile(model, backend=counter, dynamic=False)
    policy = make_bucket_policy(cfg, max_length=max_length)
    pad_rows = args.layout == "padded" and cfg.pad_to_length

    all_mbs, cold_times, compiles_by_step = [], [], []
    for step, lengths in enumerate(steps_lengths, start=1):
        batch = make_batch(lengths, seed=step)
        n_resp = float(batch.response_mask.sum())
        t0 = CLOCK()
        mbs = split_micro_batches(batch, cfg, policy, PAD, layout=args.layout, pad_rows=pad_rows)
        before = counter.count
        compiled.zero_grad(set_to_none=True)
        for mb in mbs:
            fwd_bwd(compiled, mb, args.layout, n_resp)
        cold_times.append(CLOCK() - t0)
        compiles_by_step.append(counter.count - before)
        policy.maybe_refresh(step)
        all_mbs.append((mbs, n_resp))

    compiles_cold = counter.count
    warm_times = [math.inf] * len(all_mbs)
    for _ in range(args.warm_repeats):     # min over repeats: robust to other load on the machine
        for i, (mbs, n_resp) in enumerate(all_mbs):
            t0 = CLOCK()
            compiled.zero_grad(set_to_none=True)
            for mb in mbs:
                fwd_bwd(compiled, mb, args.layout, n_resp)
            warm_times[i] = min(warm_times[i], CLOCK() - t0)
    assert counter.count == compiles_cold, "warm pass compiled a new graph"

    n = len(steps_lengths)
    second_half = compiles_by_step[n // 2:]
    stats = pad_stats([mb for mbs, _ in all_mbs for mb in mbs])
    late = pad_stats([mb for mbs, _ in all_mbs[n // 2:] for mb in mbs])
    warm = statistics.mean(warm_times)
    compile_cost = max(0.0, (sum(cold_times) - sum(warm_times))) / max(1, compiles_cold)
    # A policy can never have more shapes than its boundaries (learned: K); no padding can have
    # one per length up to the budget. Project compiles over a longer run from the second-half
    # rate, capped by that bound.
    bound = policy.max_shapes if policy.name == "learned" else len(policy.boundaries())
    rate = sum(second_half) / len(second_half)
    horizon = max(args.project_steps, n)
    projected_compiles = min(bound, compiles_cold + rate * (horizon - n))
    return {
        "policy": name,
        "pad_fraction": stats["pad_fraction"],
        "bucket_pad_fraction": stats["bucket_pad_fraction"],
        "pad_fraction_second_half": late["pad_fraction"],
        "distinct_shapes": stats["distinct_shapes"],
        "compiles": compiles_cold,
        "compiles_second_half": sum(second_half),
        "warm_step_s": warm,
        "cold_step_s": statistics.mean(cold_times),
        "compile_cost_s": compile_cost,
        "shape_bound": bound,
        "projected_compiles": projected_compiles,
        "projected_step_s": warm + compile_cost * projected_compiles / horizon,
        "boundaries": policy.boundaries() if policy.name == "learned" else None,
        "padded_tokens": stats["padded_tokens"],
        "real_tokens": stats["real_tokens"],
    }


def configs(args, max_seq: int):
    base = dict(max_tokens_per_micro_batch=args.budget, micro_batch_size=0,
                pad_to_length_max_shapes=args.max_shapes, pad_to_length_refresh_steps=args.refresh)
    fixed = args.budget if args.layout == "packed" else max_seq
    return [
        ("no padding", FSDPEngineConfig(**base, pad_to_length=False)),
        (f"fixed ({fixed})", FSDPEngineConfig(**base, pad_to_length=True, pad_to_length_bucket=fixed)),
        ("multiple of 1024", FSDPEngineConfig(**base, pad_to_length=True, pad_to_length_bucket=1024)),
        ("multiple of 16", FSDPEngineConfig(**base, pad_to_length=True, pad_to_length_bucket=16)),
        ("geometric", FSDPEngineConfig(**base, pad_to_length=True, pad_to_length_bucket=16,
                                       pad_to_length_policy="geometric")),
        (f"learned (K={args.max_shapes})", FSDPEngineConfig(**base, pad_to_length=True, pad_to_length_bucket=16,
                                                             pad_to_length_policy="learned")),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--layout", choices=["packed", "padded"], default="packed")
    ap.add_argument("--budget", type=int, default=0,
                    help="max_tokens_per_micro_batch (default 2048 packed, 8192 padded)")
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--max-shapes", type=int, default=8)
    ap.add_argument("--refresh", type=int, default=2, help="learned: refit every N steps")
    ap.add_argument("--lengths", default="", help="replay sequence lengths from this dump")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: process CPU seconds (robust on a shared machine); wall: elapsed")
    ap.add_argument("--policies", default="", help="comma-separated subset of row numbers (0 = no padding)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-repeats", type=int, default=3, help="warm passes; the min per step is kept")
    ap.add_argument("--project-steps", type=int, default=500, help="run length for the projection")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    args.budget = args.budget or (2048 if args.layout == "packed" else 8192)
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 100_000)  # never fall back to eager silently

    if args.lengths:
        steps_lengths = file_lengths(args.lengths, args.batch, args.steps)
        source = f"{args.lengths} ({len(steps_lengths)} steps x {args.batch})"
    else:
        steps_lengths = synthetic_lengths(args.steps, args.batch, args.max_prompt, args.max_new, args.seed)
        source = f"synthetic long-tailed, drifting ({args.steps} steps x {args.batch})"
    max_seq = max(max(s) for s in steps_lengths) if args.lengths else args.max_prompt + args.max_new
    args.max_pos = max(max_seq, args.budget) + 16
    all_lens = [n for s in steps_lengths for n in s]
    q = statistics.quantiles(all_lens, n=20)
    print(f"lengths: {source}; median {statistics.median(all_lens):.0f}, p95 {q[18]:.0f}, "
          f"max {max(all_lens)}; layout {args.layout}, budget {args.budget} tokens/micro-batch, "
          f"backend {args.backend}, torch threads {torch.get_num_threads()}, "
          f"clock {args.clock} seconds", flush=True)

    base_state = copy.deepcopy(tiny_llama(args.max_pos).state_dict())
    max_length = max_seq if args.layout == "padded" else None
    results = []
    rows = configs(args, max_seq)
    if args.policies:
        keep = {int(i) for i in args.policies.split(",")} | {0}
        rows = [r for i, r in enumerate(rows) if i in keep]
    for name, cfg in rows:
        t0 = time.perf_counter()
        r = run_policy(name, cfg, max_length, steps_lengths, args, base_state)
        results.append(r)
        print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)

    base = results[0]
    proj = f"s/step@{max(args.project_steps, len(steps_lengths))}"
    head = (f"{'policy':<18}{'pad %':>7}{'2nd half':>9}{'shapes':>7}{'compiles':>9}{'2nd half':>9}"
            f"{'bound':>7}{'warm s/step':>12}{'x':>6}{'cold s/step':>12}{'x':>6}{proj:>14}{'x':>6}")
    print()
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['policy']:<18}{100 * r['pad_fraction']:>7.1f}{100 * r['pad_fraction_second_half']:>9.1f}"
              f"{r['distinct_shapes']:>7}{r['compiles']:>9}{r['compiles_second_half']:>9}{r['shape_bound']:>7}"
              f"{r['warm_step_s']:>12.3f}{r['warm_step_s'] / base['warm_step_s']:>6.2f}"
              f"{r['cold_step_s']:>12.3f}{r['cold_step_s'] / base['cold_step_s']:>6.2f}"
              f"{r['projected_step_s']:>14.3f}{r['projected_step_s'] / base['projected_step_s']:>6.2f}")
    learned = results[-1]
    print(f"\nlearned boundaries: {learned['boundaries']}")
    print(f"mean cost of one compile (cold - warm) / compiles, no padding: {base['compile_cost_s']:.2f} s")
    print("pad %: (padded - real) / padded tokens, over all steps and over the second half "
          "(after policy=learned has fitted).\ncompiles / 2nd half: graphs compiled over the run "
          "and in its second half (a policy that has converged compiles nothing more); bound: "
          "most shapes the policy can ever have.\nwarm s/step: fwd+bwd with every shape "
          f"compiled (min of {args.warm_repeats} passes); cold: first pass, compiles included.\n"
          f"{proj}: projection to a {max(args.project_steps, len(steps_lengths))}-step run = warm + "
          "compile cost x min(bound, compiles + 2nd-half rate x remaining steps) / steps.")
    if args.layout == "packed":
        print("multiple of 1024 with a 2048 budget has two possible shapes (1024, 2048): with "
              "sequences in the hundreds it is nearly the fixed budget.")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
