"""The vLLM GPU check's Python (bench/gpu_check_vllm.sh runs it; the steps are listed there).

A file, not a heredoc fed to `python -`: with CUDA already in use in this process, vLLM starts
its engine process by "spawn", which re-imports the parent's main script from its file; code
read from stdin has none (`<stdin>`), and the engine failed to start."""
import sys
import time
from contextlib import contextmanager

import torch

GiB = float(1 << 30)
failed = []


def gib(n):
    return f"{n / GiB:8.3f} GiB"


def check(ok, what):
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        failed.append(what)


def used(dev):
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    return total - free


def main():
    print("== environment")
    print(f"  torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    if not torch.cuda.is_available():
        print("  MISSING: a CUDA device (and a CUDA build of torch). Nothing to check here.")
        sys.exit(2)
    from engine.rollout.vllm_sampler import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        print(f"  MISSING: vllm ({reason}). On a CUDA machine: pip install vllm (its wheel pins a CUDA "
              f"torch; use a separate venv if the project's torch differs). See docs/vllm.md.")
        sys.exit(2)
    import vllm
    print(f"  vllm {vllm.__version__}")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    print(f"  device: {torch.cuda.get_device_name(dev)}, "
          f"{torch.cuda.get_device_properties(dev).total_memory / GiB:.1f} GiB")

    from engine.algorithms.logprobs import token_log_probs
    from engine.config.load import load_run_config
    from engine.model.build import build_hf_model, tiny_hf_config
    from engine.rollout.vllm_sampler import VLLMSampler

    V, PAD, EOS, T = 1024, 0, 1, 0.8
    cfg = load_run_config([
        "rollout=vllm", "trainer.device=cuda", "model.dtype=bfloat16", "model.hidden_size=512",
        "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.num_layers=8",
        "model.intermediate_size=1024", "model.max_position_embeddings=256", "data.max_prompt_length=32",
        f"rollout.temperature={T}", "rollout.max_new_tokens=48", "rollout.gpu_memory_utilization=0.3",
        "data.train_batch_size=64", "algorithm.rollout_n=8", "task.num_val=0"]).config
    model = build_hf_model(cfg.model, "", V, seed=0, pad_token_id=PAD, eos_token_id=EOS).to(dev).eval()

    class Trainer:  # what verify_sync needs from an engine
        device = dev

        @contextmanager
        def generation_model(self):
            yield model

    def recompute(batch, temp):
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev)).logits
            lp, _ = token_log_probs(logits, batch.input_ids.to(dev), temp)
        return lp.float().cpu()

    print("\n== 1. start vLLM beside the trainer's model")
    base = used(dev)
    t0 = time.perf_counter()
    s = VLLMSampler(cfg, tiny_hf_config(cfg.model, V, PAD, EOS), model.state_dict(), PAD, EOS, dev)
    print(f"  started in {time.perf_counter() - t0:.1f} s; device used {gib(base)} -> {gib(used(dev))}")
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, V, (int(L),), generator=g).tolist()
                   for L in torch.randint(4, 32, (64,), generator=g)]

        print("\n== 2. generate: layout and log-probs vs the trainer")
        t0 = time.perf_counter()
        b = s.generate(None, prompts, 8, torch.Generator().manual_seed(1))
        dt = time.perf_counter() - t0
        m = b.response_mask
        print(f"  {len(b)} rows, {int(m.sum())} tokens in {dt:.2f} s ({m.sum() / dt:.0f} tok/s)")
        check(len(b) == 512 and bool((b.prompt_lengths == torch.tensor([len(p) for p in prompts]).repeat_interleave(8)).all()),
              "512 rows, prompt-major, prompt lengths in place")
        diff = ((b.rollout_log_probs - recompute(b, T)).abs() * m).sum() / m.sum()
        check(float(diff) <= 0.05, f"sampled-token log-probs vs trainer recompute: mean |diff| {float(diff):.4f} (bf16, <= 0.05)")

        print("\n== 3. memory")
        mem = s.memory()
        for k, v in mem.items():
            print(f"  {k:28s} {gib(v) if isinstance(v, int) and not isinstance(v, bool) else v}")
        check(mem["kv_cache_bytes"] > 0, "KV-cache size reported")
        check(mem.get("outside_torch_bytes", 0) > mem["kv_cache_bytes"], "memory outside torch covers the KV cache")

        print("\n== 4. trainer update (vLLM now stale), then sleep (level 1: KV cache freed, weights to host)")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        stale = s.verify_sync(Trainer(), b, raise_on_mismatch=False)
        check(not stale.ok, f"verify_sync sees the stale weights (max {stale.max_abs:.3f}, mean {stale.mean_abs:.4f})")
        awake = used(dev)
        t0 = time.perf_counter()
        s.sleep()
        t_sleep = time.perf_counter() - t0
        asleep = used(dev)
        freed1 = awake - asleep
        print(f"  {t_sleep:.2f} s; device used {gib(awake)} -> {gib(asleep)}: freed {gib(freed1)} "
              f"({freed1 / max(1, mem['kv_cache_bytes']):.2f}x the KV cache)")
        check(freed1 >= 0.9 * mem["kv_cache_bytes"], "sleep frees at least 90% of the KV cache's bytes")
        check(s.memory()["kv_cache_bytes"] == 0, "memory() reports no KV cache while asleep")

        print("\n== 5. sync while asleep (wake weights -> reload -> wake KV cache -> reset prefix cache)")
        t0 = time.perf_counter()
        sync_s = s.sync_weights(model.state_dict())
        print(f"  sync {sync_s:.3f} s (wall {time.perf_counter() - t0:.3f} s): {s.last_sync}")
        back = used(dev)
        print(f"  device used after wake: {gib(back)} (before sleep {gib(awake)})")
        check(abs(back - awake) <= 0.05 * awake, "wake restores device memory to within 5% of before sleep")
        chk = s.verify_sync(Trainer(), b)
        print(f"  verify_sync: max {chk.max_abs:.4f}, mean {chk.mean_abs:.4f} over {chk.tokens} tokens (tol {chk.tol})")
        check(chk.ok, "verify_sync passes after the sync")
        b2 = s.generate(None, prompts, 8, torch.Generator().manual_seed(2))
        m2 = b2.response_mask
        diff2 = ((b2.rollout_log_probs - recompute(b2, T)).abs() * m2).sum() / m2.sum()
        check(float(diff2) <= 0.05, f"fresh rollout follows the new weights: mean |diff| {float(diff2):.4f}")

        print("\n== 6. second sleep/wake cycle")
        awake2 = used(dev)
        s.sleep()
        freed2 = awake2 - used(dev)
        t0 = time.perf_counter()
        s.wake_up()
        print(f"  freed {gib(freed2)} (first {gib(freed1)}); wake {time.perf_counter() - t0:.2f} s")
        check(abs(freed2 - freed1) <= 0.1 * freed1, "second cycle frees the same bytes (within 10%)")
    finally:
        s.shutdown()
    print("\n== result:", "all checks passed" if not failed else f"{len(failed)} FAILED: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
