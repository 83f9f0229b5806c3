"""Routing replay: the rollout-vs-trainer log-prob gap with and without replay, same run.

A tiny mixture-of-experts model (transformers Mixtral / Qwen3-MoE / Qwen2-MoE, random init,
built offline) is trained in fp32 by the real FSDP2 engine (one gloo rank, in this process).
Its rollout runs on a bfloat16 copy of the same weights through the torch sampler, recording
each token's experts: bf16 moves router logits enough that near-ties flip, so the rollout and
the trainer route some tokens differently, as a bf16 inference engine and an fp32 trainer do.
The engine then measures, on the same rollout batch (``FSDPEngine.routing_report``):

  routing mismatch      share of tokens whose trainer top-k differs from the rollout's (any layer)
  |Δ log p|, KL         mean |log p_train - log p_rollout| and approx KL(rollout || train) on the
                        sampled tokens, with the trainer's own routing and with replay

and prints the ratio no-replay / replay. A control row rolls out in fp32 with the trainer's own
model (no precision difference): routing agrees and both gaps are ~0. A third row isolates
routing: the fp32 model rolls out, but its routers pick their top-k from bf16-rounded logits
(gate weights from the fp32 logits): routing is then the only difference, and replay closes
the gap to ~0. What replay leaves of the bf16 gap is precision, not routing.

It also times, in the same run (CPU seconds of this process, min of --repeats): the rollout
with and without recording, and the trainer's log-prob pass with and without replay.

    python bench/router_replay.py                         # ~1 min on a 2-core machine
    python bench/router_replay.py --arch qwen3_moe --experts 64 --top-k 4
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402


def build_model_dir(out: Path, arch: str, experts: int, top_k: int, layers: int, hidden: int, seed: int):
    import transformers as tf

    from engine.config.schema import TaskConfig
    from engine.model.tokenizer import CharTokenizer
    from engine.tasks.registry import make_task

    tok = CharTokenizer(make_task(TaskConfig(), 0).alphabet)
    common = dict(vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=None, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=top_k)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=hidden, num_local_experts=experts, sliding_window=None, **common)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden,
                                shared_expert_intermediate_size=hidden, num_experts=experts,
                                use_sliding_window=False, **common)
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden, num_experts=experts,
                                norm_topk_prob=True, head_dim=hidden // 4, **common)
    else:
        raise SystemExit(f"--arch must be mixtral, qwen2_moe or qwen3_moe, got {arch}")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return tok


def _bf16_choice(router, args, out):
    """A router hook: the top-k chosen on bf16-rounded logits, weights from the fp32 logits."""
    from engine.moe.router_replay import gate_weights

    logits, scores, _ = out
    probs = torch.softmax(logits.to(torch.bfloat16), -1, dtype=torch.float)
    idx = probs.topk(router.top_k, -1).indices
    return logits, gate_weights(router, logits, idx, scores.dtype), idx


def _timings(eng, cfg, tok, prompts, args, TorchSampler) -> dict:
    """Rollout with/without recording and the log-prob pass with/without replay, same batch."""
    import time

    def best(fn):
        times = []
        for _ in range(args.repeats):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        return min(times)

    out, batch = {}, None
    for name, record in (("rollout", False), ("rollout_record", True)):
        sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, eng.device, record_routing=record)

        def roll():
            nonlocal batch
            with eng.generation_model() as m:
                batch = sampler.generate(m, prompts, args.n, torch.Generator().manual_seed(args.seed))
        out[name] = best(roll)
    plain = batch.select(slice(0, len(batch)))
    plain.routed_experts = None  # no records: the engine's own routing
    out["log_probs"] = best(lambda: eng.compute_log_probs(plain))
    out["log_probs_replay"] = best(lambda: eng.compute_log_probs(batch))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="mixtral")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import torch.distributed as dist

    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.config.schema import TaskConfig
    from engine.moe.router_replay import attach
    from engine.moe.routers import find_routers
    from engine.moe.routing_metrics import RoutingSums, summarize
    from engine.rollout.torch_sampler import TorchSampler
    from engine.tasks.registry import make_task
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        tok = build_model_dir(path, args.arch, args.experts, args.top_k, args.layers, args.hidden, args.seed)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        cfg = load_run_config([f"model.path={path}", "algorithm.router_replay=replay",
                               f"rollout.max_new_tokens={args.max_new_tokens}"]).config
        eng = FSDPEngine(cfg, str(path), tok.vocab_size, tok.pad_token_id, tok.eos_token_id,
                         torch.device("cpu"), updates_per_step=1)
        eng.build()
        task = make_task(TaskConfig(), args.seed)
        prompts = [tok.encode(ex.prompt if hasattr(ex, "prompt") else ex["prompt"]) for ex in task.train[: args.prompts]]
        sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, eng.device, record_routing=True)

        rows = []
        with eng.generation_model() as m:  # control: the trainer's own fp32 model rolls out
            batch = sampler.generate(m, prompts, args.n, torch.Generator().manual_seed(args.seed))
        rows.append(("fp32 (control)", batch, summarize(RoutingSums(**eng.routing_report(batch)))))
        with eng.generation_model() as m:  # routing the only difference: top-k picked on bf16 logits
            hooks = [r.register_forward_hook(_bf16_choice, prepend=True) for _, r in find_routers(m)]
            batch = sampler.generate(m, prompts, args.n, torch.Generator().manual_seed(args.seed))
            for h in hooks:
                h.remove()
        rows.append(("bf16 top-k only", batch, summarize(RoutingSums(**eng.routing_report(batch)))))
        timing = _timings(eng, cfg, tok, prompts, args, TorchSampler)
        bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True,
                                                    attn_implementation="sdpa").eval()
        attach(bf16)
        batch = sampler.generate(bf16, prompts, args.n, torch.Generator().manual_seed(args.seed))
        rows.append(("bf16", batch, summarize(RoutingSums(**eng.routing_report(batch)))))

    print("overhead (CPU s, min of %d): rollout %.3f -> %.3f recording (%.2fx); log-prob pass %.3f -> %.3f "
          "replaying (%.2fx)" % (args.repeats, timing["rollout"], timing["rollout_record"],
                                 timing["rollout_record"] / timing["rollout"], timing["log_probs"],
                                 timing["log_probs_replay"], timing["log_probs_replay"] / timing["log_probs"]))
    print(f"{args.arch}: {args.experts} experts, top-{args.top_k}, {args.layers} layers, hidden {args.hidden}; "
          f"{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens; trainer fp32")
    head = (f"{'rollout':<16} {'resp tok':>8} {'mismatch':>9} {'per layer':>9} {'|dlogp| own':>12} "
            f"{'|dlogp| replay':>15} {'ratio':>7} {'KL own':>10} {'KL replay':>10}")
    print(head)
    for name, b, m in rows:
        ratio = m["logp_gap_no_replay"] / max(m["logp_gap_replay"], 1e-12)
        print(f"{name:<16} {int(b.response_mask.sum()):>8} {m['routing_mismatch']:>9.4f} "
              f"{m['routing_mismatch_layer']:>9.4f} {m['logp_gap_no_replay']:>12.3e} {m['logp_gap_replay']:>15.3e} "
              f"{ratio:>6.1f}x {m['kl_no_replay']:>10.3e} {m['kl_replay']:>10.3e}")
    os._exit(0)  # skip the gloo teardown (it can abort at interpreter exit on this torch build)


if __name__ == "__main__":
    main()
