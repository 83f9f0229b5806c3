"""The update with the fused output layer (engine.fused_lm_head), in one process, alternating
step by step on one FSDP2 engine (one gloo rank, CPU):

- ``logits``: the plain update (the output layer makes [tokens, vocab] logits, prompts shared);
- ``fused``: the fused layer with the prompts shared (each distinct prompt once; its last
  position handed to every sample inside the output layer);
- ``fused-unshared``: the fused layer where prompts cannot be shared (as under gradient
  checkpointing, compiled blocks or activation offload): only the response positions.

    OMP_NUM_THREADS=1 python bench/fused_head.py                    # vocab 32,000 (docs/benchmarks.md)
    OMP_NUM_THREADS=1 python bench/fused_head.py --vocab 151936 --steps 3

Prints the median seconds per update of each mode after one warm-up step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per mode (after one warm-up)")
    ap.add_argument("--modes", nargs="+", default=["logits", "fused", "fused-unshared"],
                    choices=["logits", "fused", "fused-unshared"])
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.batch import SequenceBatch
    from engine.config.load import load_run_config

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    P, R, rows = a.prompt_len, a.response_len, a.prompts * a.n
    base = ["engine.micro_batch_size=8", f"model.hidden_size={a.hidden}", f"model.intermediate_size={a.hidden * 11 // 4}",
            f"model.num_layers={a.layers}", "model.num_attention_heads=4", "model.num_key_value_heads=4",
            "engine.skip_zero_advantage_rows=false"]
    engines, losses = {}, {}
    for mode in a.modes:
        cfg = load_run_config([*base, f"engine.fused_lm_head={str(mode != 'logits').lower()}"]).config
        torch.manual_seed(0)
        eng = FSDPEngine(cfg, "", a.vocab, 0, 1, torch.device("cpu"), updates_per_step=1)
        eng.build()
        eng.share_prompts = mode != "fused-unshared"
        engines[mode], losses[mode] = eng, PolicyLoss(cfg.algorithm, 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, a.vocab, (rows, P + R), generator=g)
    for u in range(a.prompts):  # each prompt's samples share it
        ids[u * a.n:(u + 1) * a.n, :P] = ids[u * a.n, :P]
    resp = torch.zeros(rows, P + R)
    resp[:, P:] = 1
    batch = SequenceBatch(input_ids=ids, attention_mask=torch.ones(rows, P + R, dtype=torch.long),
                          response_mask=resp, prompt_lengths=torch.full((rows,), P),
                          advantages=torch.randn(rows, 1, generator=g) * resp, old_log_probs=torch.zeros(rows, P + R))
    times: dict[str, list[float]] = {m: [] for m in a.modes}
    for step in range(a.steps + 1):
        for mode in a.modes:
            t = time.perf_counter()
            engines[mode].train_step(batch, losses[mode])
            if step:
                times[mode].append(time.perf_counter() - t)
    print(f"{rows} rows x ({P} prompt + {R} response) tokens, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab:,}; "
          f"median s per update over {a.steps} steps:")
    for mode in a.modes:
        print(f"  {mode:15s} {statistics.median(times[mode]):8.3f}")


if __name__ == "__main__":
    main()
