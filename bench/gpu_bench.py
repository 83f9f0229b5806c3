"""rl's rollout and update beside a plain Hugging Face loop, on the same model, batch and lengths,
in one process run (issue 41). Made for one lent H200 (all of it well under 5 minutes there);
``--shape tiny --device cpu`` runs here in seconds (tests/test_gpu_bench.py).

    python bench/gpu_bench.py --json /tmp/gpu_bench.json                       # 135m and 0.5b on cuda, bf16
    OMP_NUM_THREADS=2 python bench/gpu_bench.py --shape tiny --device cpu --steps 1

Per shape, each phase measured ``--steps`` times after one warm-up, medians:
``rl_rollout``  -- engine/rollout/torch_sampler.TorchSampler on the FSDP2 engine's generation model;
``rl_update``   -- FSDPEngine.train_step with the real PolicyLoss on GRPO advantages of random rewards
                   (engine.micro_batch_size=32);
``hf_generate`` -- ``model.generate(do_sample=True)`` on an identical copy of the weights, same prompts,
                   same number of new tokens (min = max: no early stop, as rollout.ignore_eos=true);
``hf_train``    -- forward + backward + AdamW on the same sequences in micro-batches of 32
                   (fp32 master weights, autocast to the compute dtype, as the engine does);
``rl_rollout_cuda_graphs`` -- the same rollout with rollout.cuda_graphs (engine/rollout/graphed_decode.py:
                   each decode step replayed from a CUDA graph; eager on cpu) from the same sampling
                   noise; ``cuda_graphs_same_tokens`` is, per step, the share of tokens both sampled alike.
MFU = achieved FLOP/s / a matmul peak measured in this run (8192^2 on cuda, 1024^2 on cpu, in the
compute dtype), with FLOPs = 2 x N x generated tokens (generation) and 6 x N x (prompt + response)
tokens (training), N = matmul parameters (all parameters less the input embedding, unless tied).
The update's fixed cost: rl_update's seconds for 1, 2, 4 and 8 rows (``update_rows``).
The decode bound: bytes read per decode step (matmul weights in the compute dtype + the mean KV
cache) / a device copy bandwidth measured in the run, as generated tokens/s.
Peak memory: torch.cuda.max_memory_allocated per phase on cuda; on cpu the process's peak RSS so far
(monotone, so per phase it is only an upper bound).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

SHAPES = {  # model overrides, batch (prompts, samples, prompt tokens, new tokens)
    "tiny": dict(model=dict(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=False), vocab=512,
                 prompts=4, n=4, prompt_len=8, new_tokens=8),
    "135m": dict(model=dict(hidden_size=1024, intermediate_size=2816, num_layers=12, num_attention_heads=16,
                            num_key_value_heads=4, tie_word_embeddings=False), vocab=512,
                 prompts=64, n=8, prompt_len=32, new_tokens=128),
    "0.5b": dict(model=dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_attention_heads=14,
                            num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True), vocab=151936,
                 prompts=64, n=8, prompt_len=32, new_tokens=128),
}
UPDATE_ROWS = (1, 2, 4, 8)
MICRO_BATCH = 32


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """The n^3 matmul rate (FLOP/s) in ``dtype`` on ``device``: the peak MFU is measured against."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10 if device.type == "cuda" else 1):
            a @ b
            reps += 1
        _sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def copy_bandwidth(device: torch.device, seconds: float = 0.5) -> float:
    """Bytes/s moved by a device-to-device copy (read + write counted)."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        reps += 1
        _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


class PhaseMeter:
    """Seconds and peak memory of one phase."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync(self.device)
        self.seconds = time.perf_counter() - self.t0
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:  # ru_maxrss is KiB on Linux
            self.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return False


def _phase(samples: list[tuple[float, float, int]], flops_per_token: float, peak: float, formula: str) -> dict:
    """samples: (seconds, tokens, peak bytes) per measured step -> the phase's medians."""
    seconds = statistics.median(s for s, _, _ in samples)
    tokens = statistics.median(t for _, t, _ in samples)
    tps = tokens / seconds
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tps, "flops_per_token": flops_per_token,
            "mfu": flops_per_token * tps / peak, "mfu_formula": formula,
            "peak_memory_bytes": max(m for _, _, m in samples), "steps": len(samples)}


def _hf_train_step(model, optimizer, input_ids, attention_mask, loss_mask, advantages, device, autocast_dtype):
    """One plain update: micro-batches of 32 sequences, a token-mean policy-gradient loss, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    total = loss_mask[:, 1:].sum().clamp(min=1)
    for i in range(0, input_ids.shape[0], MICRO_BATCH):
        ids, am = input_ids[i:i + MICRO_BATCH], attention_mask[i:i + MICRO_BATCH]
        lm, adv = loss_mask[i:i + MICRO_BATCH, 1:], advantages[i:i + MICRO_BATCH, None]
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
            logits = model(input_ids=ids, attention_mask=am).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss = -(ratio * adv * lm).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def bench_shape(name: str, device: torch.device, dtype: str, steps: int, peak: float, bandwidth: float) -> dict:
    from engine.algorithms.advantages import grpo_advantages, token_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.model.build import build_hf_model
    from engine.rollout.torch_sampler import TorchSampler

    s = SHAPES[name]
    m = s["model"]
    overrides = [f"model.{k}={v}" for k, v in m.items()] + [
        f"model.dtype={dtype}", f"model.max_position_embeddings={max(128, s['prompt_len'] + s['new_tokens'])}",
        f"rollout.max_new_tokens={s['new_tokens']}", "rollout.ignore_eos=true",
        f"engine.micro_batch_size={MICRO_BATCH}", "optim.lr=1e-5"]
    cfg = load_run_config(overrides).config
    PAD, EOS = 0, 1
    eng = FSDPEngine(cfg, "", s["vocab"], PAD, EOS, device, 1)
    eng.build()
    sampler = TorchSampler(cfg.rollout, PAD, EOS, eng.device)
    graphed = TorchSampler(cfg.rollout, PAD, EOS, eng.device)  # rollout.cuda_graphs (engine/rollout/graphed_decode.py)
    graphed.static_shapes = True
    loss_fn = PolicyLoss(cfg.algorithm, 1)
    # the plain loop's copy: the same seeded random init, fp32 masters on the device
    hf = build_hf_model(cfg.model, "", s["vocab"], cfg.trainer.seed, PAD, EOS).float().to(device)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=tuple(cfg.optim.betas), weight_decay=0.0)
    compute_dtype = getattr(torch, dtype)

    n_params = sum(p.numel() for p in hf.parameters())
    embed = m["hidden_size"] * s["vocab"]
    matmul_params = n_params - (0 if m["tie_word_embeddings"] else embed)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, s["vocab"], (s["prompt_len"],), generator=g).tolist() for _ in range(s["prompts"])]
    prompt_ids = torch.tensor(prompts, device=device)
    gen = torch.Generator().manual_seed(0)  # the rank's CPU generator: the sampler seeds its device one from it

    phases = {k: [] for k in ("rl_rollout", "rl_update", "hf_generate", "hf_train", "rl_rollout_cuda_graphs")}
    split, graphs_equal = [], []
    for step in range(steps + 1):
        state = gen.get_state()
        with PhaseMeter(device) as pm:
            with eng.generation_model() as model:
                batch = sampler.generate(model, prompts, s["n"], gen)
        roll = (pm.seconds, float(batch.response_mask.sum()), pm.peak_bytes)
        after = gen.get_state()
        gen.set_state(state)  # the same noise: the graphed rollout must sample the same tokens
        with PhaseMeter(device) as pm:
            with eng.generation_model() as model:
                gbatch = graphed.generate(model, prompts, s["n"], gen)
        groll = (pm.seconds, float(gbatch.response_mask.sum()), pm.peak_bytes)
        gen.set_state(after)
        # the share of equal tokens, not a yes/no: the graphed step attends over the whole static
        # cache (masked), the eager one over the filled part, so bf16 sums differ in the last bits
        # and inverse-CDF sampling can flip a few tokens; ~1.0 is right, far below it is not
        same = gbatch.input_ids.shape == batch.input_ids.shape
        graphs_equal.append(float((gbatch.input_ids == batch.input_ids).float().mean()) if same else 0.0)
        rewards = torch.rand(len(batch), generator=g)
        batch.advantages = token_advantages(grpo_advantages(rewards, s["n"]), batch.response_mask)
        with PhaseMeter(device) as pm:
            stats = eng.train_step(batch, loss_fn)
        upd = (pm.seconds, float(stats.tokens), pm.peak_bytes)

        hf.eval()
        with PhaseMeter(device) as pm, torch.no_grad(), torch.autocast(
                device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            out = hf.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
                              num_return_sequences=s["n"], max_new_tokens=s["new_tokens"],
                              min_new_tokens=s["new_tokens"], pad_token_id=PAD, eos_token_id=EOS, top_k=0,
                              temperature=1.0)
        hgen = (pm.seconds, float((out.shape[1] - s["prompt_len"]) * out.shape[0]), pm.peak_bytes)
        hf.train()
        am = torch.ones_like(out)
        loss_mask = torch.zeros_like(out)
        loss_mask[:, s["prompt_len"]:] = 1
        adv = torch.randn(out.shape[0], device=device, generator=None)
        with PhaseMeter(device) as pm:
            _hf_train_step(hf, hf_opt, out, am, loss_mask, adv, device, compute_dtype)
        htrain = (pm.seconds, float(out.numel()), pm.peak_bytes)
        if step == 0:
            continue  # warm-up
        for k, v in zip(phases, (roll, upd, hgen, htrain, groll)):
            phases[k].append(v)
        split.append({"rollout": roll[0], "advantages_and_update": upd[0]})

    gen_formula = "2 * matmul_params * generated tokens / s / matmul_peak"
    train_formula = "6 * matmul_params * (prompt + response) tokens / s / matmul_peak"
    out_phases = {
        "rl_rollout": _phase(phases["rl_rollout"], 2 * matmul_params, peak, gen_formula),
        "rl_update": _phase(phases["rl_update"], 6 * matmul_params, peak, train_formula),
        "hf_generate": _phase(phases["hf_generate"], 2 * matmul_params, peak, gen_formula),
        "hf_train": _phase(phases["hf_train"], 6 * matmul_params, peak, train_formula),
        "rl_rollout_cuda_graphs": _phase(phases["rl_rollout_cuda_graphs"], 2 * matmul_params, peak, gen_formula),
    }

    # the fixed cost of an update: rows 1..8 (one prompt each, random advantages, no zero rows)
    update_rows = {}
    for rows in UPDATE_ROWS:
        with eng.generation_model() as model:
            b = sampler.generate(model, prompts[:rows], 1, gen)
        b.advantages = token_advantages(torch.randn(len(b), generator=g), b.response_mask)
        times = []
        for rep in range(2):
            with PhaseMeter(device) as pm:
                st = eng.train_step(b, loss_fn)
            times.append(pm.seconds)
        update_rows[str(rows)] = {"seconds": min(times), "tokens": float(st.tokens)}

    # decode bound: every decode step reads the matmul weights and the KV cache
    elt = torch.finfo(compute_dtype).bits // 8
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    rows = s["prompts"] * s["n"]
    mean_ctx = s["prompt_len"] + s["new_tokens"] / 2
    kv_bytes = 2 * m["num_layers"] * m["num_key_value_heads"] * head_dim * elt * rows * mean_ctx
    weight_bytes = matmul_params * elt
    step_s = (weight_bytes + kv_bytes) / bandwidth
    decode = {"weight_bytes": weight_bytes, "mean_kv_cache_bytes": kv_bytes, "bandwidth_bytes_per_s": bandwidth,
              "seconds_per_decode_step": step_s, "rows": rows, "bound_tokens_per_s": rows / step_s,
              "formula": "rows / ((matmul_params * dtype bytes + 2 * layers * kv_heads * head_dim * dtype bytes"
                         " * rows * (prompt_len + new_tokens / 2)) / copy bandwidth)"}

    del eng, hf, hf_opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": name, "model": m, "vocab": s["vocab"], "params": n_params, "matmul_params": matmul_params,
            "batch": {"prompts": s["prompts"], "samples": s["n"], "prompt_len": s["prompt_len"],
                      "new_tokens": s["new_tokens"]},
            "phases": out_phases, "step_split_s": split, "cuda_graphs_same_tokens": graphs_equal, "update_rows": update_rows, "decode_bound": decode,
            "ratios_rl_over_hf": {
                "generate_tokens_per_s": out_phases["rl_rollout"]["tokens_per_s"] / out_phases["hf_generate"]["tokens_per_s"],
                "train_tokens_per_s": out_phases["rl_update"]["tokens_per_s"] / out_phases["hf_train"]["tokens_per_s"]}}


def _write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=None,
                    help="default: 135m 0.5b on cuda, tiny on cpu")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per phase, after one warm-up")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    device = torch.device(dev)
    dtype = args.dtype or ("bfloat16" if dev == "cuda" else "float32")
    shapes = args.shape or (["135m", "0.5b"] if dev == "cuda" else ["tiny"])
    if dev == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))

    import torch.distributed as dist

    store = tempfile.mktemp()
    dist.init_process_group("cuda:nccl,cpu:gloo" if dev == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)
    if dev == "cuda":
        torch.cuda.set_device(0)
    peak = matmul_peak(device, getattr(torch, dtype))
    bandwidth = copy_bandwidth(device)
    results = []
    report = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "dtype": dtype,
              "matmul_peak_flops": peak, "matmul_peak_note": f"{'8192' if dev == 'cuda' else '1024'}^3 {dtype} matmul",
              "copy_bandwidth_bytes_per_s": bandwidth, "steps": args.steps, "shapes": results}
    try:
        for name in shapes:
            results.append(bench_shape(name, device, dtype, args.steps, peak, bandwidth))
            report["elapsed_s"] = time.perf_counter() - t_start
            print(f"{name}: done at {report['elapsed_s']:.1f} s", flush=True)
            _write_json(args.json, report)  # what is done survives a time limit
    finally:
        dist.destroy_process_group()
    elapsed = report["elapsed_s"] = time.perf_counter() - t_start
    print(f"device {report['device']}, {dtype}, matmul peak {peak / 1e12:.2f} TFLOP/s, "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {args.steps} steps after 1 warm-up (medians)")
    for r in results:
        print(f"--- {r['shape']}: {r['params']:,} params ({r['matmul_params']:,} in matmuls), "
              f"{r['batch']['prompts']} prompts x {r['batch']['samples']} x {r['batch']['new_tokens']} new tokens")
        print(f"{'phase':12s} {'s':>8s} {'tok/s':>12s} {'MFU':>7s} {'peak MiB':>9s}")
        for k, p in r["phases"].items():
            print(f"{k:12s} {p['seconds']:8.3f} {p['tokens_per_s']:12,.0f} {100 * p['mfu']:6.2f}% "
                  f"{p['peak_memory_bytes'] / 2 ** 20:9.0f}")
        ratios = r["ratios_rl_over_hf"]
        print(f"rl / HF: generation {ratios['generate_tokens_per_s']:.2f}x, training {ratios['train_tokens_per_s']:.2f}x")
        print("update seconds by rows: " + ", ".join(f"{k}: {v['seconds']:.3f}" for k, v in r["update_rows"].items()))
        d = r["decode_bound"]
        print(f"decode bound: {d['bound_tokens_per_s']:,.0f} tok/s ({d['seconds_per_decode_step'] * 1e3:.2f} ms/step "
              f"for {d['rows']} rows)")
    print(f"elapsed {elapsed:.1f} s")
    _write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
