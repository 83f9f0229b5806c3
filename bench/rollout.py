"""Rollout throughput, torch (the built-in KV-cache sampler) vs vLLM, for two model sizes and
two batch sizes, measured in one run; prints vLLM's tokens/s as a ratio of torch's.

    /work/venv-vllm/bin/python bench/rollout.py                 # needs vllm importable
    /work/venv-vllm/bin/python bench/rollout.py --json out.json --new-tokens 32

Both samplers get the same model weights (random init, Llama-style, fp32), the same prompts
and the same thread count (OMP_NUM_THREADS; vLLM's worker inherits it). Each measured call is
preceded by one warm-up call; tokens/s counts generated response tokens (EOS included) over
wall time of the generate call. Also reported per model: vLLM engine start and one weight
sync (write + in-place reload + prefix-cache reset).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

MODELS = {  # name -> (hidden, layers, heads, kv_heads, intermediate); head_dim 32 and 64
    "h128-L2": (128, 2, 4, 2, 256),
    "h512-L8": (512, 8, 8, 4, 1024),
}


def _overrides(spec, vocab_prompt_len: int, new_tokens: int, rows: int) -> list[str]:
    h, layers, heads, kv, inter = spec
    return ["rollout=vllm", "trainer.device=cpu", f"model.hidden_size={h}", f"model.num_layers={layers}",
            f"model.num_attention_heads={heads}", f"model.num_key_value_heads={kv}",
            f"model.intermediate_size={inter}", "model.max_position_embeddings=256",
            f"data.max_prompt_length={vocab_prompt_len}", f"rollout.max_new_tokens={new_tokens}",
            f"data.train_batch_size={rows}", "algorithm.rollout_n=1", "algorithm.name=reinforce_pp",  # no group: a rollout-only job
            "task.num_val=0"]


def _tokens_per_s(gen, prompts, n, reps: int) -> tuple[float, int]:
    gen(prompts, n, 0)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for r in range(reps):
        tokens += int(gen(prompts, n, r + 1).response_mask.sum())
    return tokens / (time.perf_counter() - t0), tokens // reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompts", type=int, nargs=2, default=[4, 32], help="two batch sizes (prompts)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)

    from engine.config.load import load_run_config
    from engine.model.build import build_hf_model, tiny_hf_config
    from engine.rollout.torch_sampler import TorchSampler
    from engine.rollout.vllm_sampler import VLLMSampler, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        raise SystemExit(f"vllm cannot be imported ({reason}); see docs/vllm.md")
    PAD, EOS = 0, 1
    g = torch.Generator().manual_seed(0)
    all_prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist()
                   for _ in range(max(args.prompts))]
    rows_out = []
    for name in args.models:
        spec = MODELS[name]
        cfg = load_run_config(_overrides(spec, args.prompt_len, args.new_tokens, max(args.prompts) * args.n)).config
        model = build_hf_model(cfg.model, "", args.vocab, seed=0, pad_token_id=PAD, eos_token_id=EOS).eval()
        params = sum(p.numel() for p in model.parameters())
        torch_s = TorchSampler(cfg.rollout, PAD, EOS, torch.device("cpu"))
        t0 = time.perf_counter()
        vllm_s = VLLMSampler(cfg, tiny_hf_config(cfg.model, args.vocab, PAD, EOS), model.state_dict(), PAD, EOS,
                             torch.device("cpu"), rows_per_call=max(args.prompts) * args.n)
        start_s = time.perf_counter() - t0
        sync_s = vllm_s.sync_weights(model.state_dict())
        try:
            for P in args.prompts:
                prompts = all_prompts[:P]
                t_tps, t_tok = _tokens_per_s(
                    lambda p, n, s: torch_s.generate(model, p, n, torch.Generator().manual_seed(s)),
                    prompts, args.n, args.reps)
                v_tps, v_tok = _tokens_per_s(
                    lambda p, n, s: vllm_s.generate(None, p, n, torch.Generator().manual_seed(s)),
                    prompts, args.n, args.reps)
                row = {"model": name, "params": params, "rows": P * args.n, "torch_tok_s": t_tps,
                       "vllm_tok_s": v_tps, "ratio": v_tps / t_tps, "torch_tokens": t_tok, "vllm_tokens": v_tok,
                       "vllm_start_s": start_s, "vllm_sync_s": sync_s}
                rows_out.append(row)
                print(f"{name:8s} {params / 1e6:6.2f}M  rows {row['rows']:4d}  torch {t_tps:9.0f} tok/s  "
                      f"vllm {v_tps:9.0f} tok/s  vllm/torch {row['ratio']:5.2f}x", flush=True)
        finally:
            vllm_s.shutdown()
    print(f"\nrollout tokens/s, {threads} thread(s), prompt {args.prompt_len} tokens, up to {args.new_tokens} new, "
          f"n={args.n}, vocab {args.vocab}, fp32, {args.reps} timed calls after 1 warm-up")
    print(f"{'model':8s} {'params':>8s} {'rows':>5s} {'torch tok/s':>12s} {'vllm tok/s':>11s} {'vllm/torch':>10s} "
          f"{'vllm start':>10s} {'sync':>8s}")
    for r in rows_out:
        print(f"{r['model']:8s} {r['params'] / 1e6:7.2f}M {r['rows']:5d} {r['torch_tok_s']:12.0f} "
              f"{r['vllm_tok_s']:11.0f} {r['ratio']:9.2f}x {r['vllm_start_s']:9.1f}s {r['vllm_sync_s'] * 1e3:6.0f}ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads, "args": vars(args), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
