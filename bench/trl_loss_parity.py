"""One GRPO update, rl against TRL's GRPOTrainer, on the same batch: loss and gradient.

    OMP_NUM_THREADS=2 python bench/trl_loss_parity.py            # needs the `bench` extra (trl)
    OMP_NUM_THREADS=2 python bench/trl_loss_parity.py --json out.json

A bench-only cross-check (issue 39): the tests check rl's loss against the formulas written in
plain PyTorch (tests/test_update_parity.py); this checks it against another implementation.
The batch is built here: a random-init tiny Llama with a byte-level BPE tokenizer (bench/learning.py's
job: pad 0, BOS 1, EOS 2), 4 prompts of the same token length (TRL's training forward gives
left-padded prompts positions that count the padding, rl's does not: equal lengths keep the
comparison about the loss) x 8 samples drawn by rl's sampler, responses ending with EOS at
different positions and some cut at the limit, rewards from the job's partial-credit function,
advantages as each tool computes them. rl's gradient comes from its FSDP engine's train_step
(one real gloo rank; the gradient read just before the optimizer step), TRL's from
``GRPOTrainer._compute_loss`` + backward. Both with ``loss_agg_mode=seq-mean-token-mean`` /
``loss_type="grpo"``, and with ``token-mean`` / ``"bnpo"``; old log-probs perturbed so the clip is
active on some tokens.

Measured (2026-12-04): losses equal to 6 digits; gradients equal to ~1e-6 relative in every
parameter but one row: the pad token's input embedding, which TRL's model never trains
(``nn.Embedding(padding_idx=pad)``) and rl trains when the policy samples the pad token mid-response
(a real token then; tests/test_fsdp_engine.py). That row makes the whole-gradient relative error
~2e-2 here (``--per-tensor`` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"seq-mean-token-mean": "grpo", "token-mean": "bnpo"}


def make_batch(model_dir: Path, job_dir: Path, G: int = 8, max_new: int = 16):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config.schema import RolloutConfig
    from engine.rollout.torch_sampler import TorchSampler

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(x) for x in (job_dir / "train.jsonl").read_text().splitlines()]
    by_len: dict[int, list] = {}
    for r in rows:
        by_len.setdefault(len(tok.encode(r["prompt"], add_special_tokens=False)), []).append(r)
    same = max(by_len.values(), key=len)[:4]
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in same]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():  # make EOS likely enough that responses end at different positions
        model.lm_head.weight[2] += 0.06 * model.model.norm.weight.sign()
    sampler = TorchSampler(RolloutConfig(max_new_tokens=max_new), 0, 2, torch.device("cpu"))
    batch = sampler.generate(model, prompts, G, torch.Generator().manual_seed(0))
    sys.path.insert(0, str(job_dir))
    from learning_reward import score

    mask = batch.response_mask
    texts = [tok.decode(batch.input_ids[i][mask[i] > 0].tolist(), skip_special_tokens=True) for i in range(len(batch))]
    rewards = torch.tensor([score(t, same[i // G]["answer"]) for i, t in enumerate(texts)])
    return model, batch, rewards, same


def rl_grad(rank, world, model_dir, batch, rewards, mode, G):
    import torch

    from engine.algorithms.estimators import compute_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config

    cfg = load_run_config([f"model.path={model_dir}", f"algorithm.loss_agg_mode={mode}", "algorithm.clip_ratio_low=0.2",
                           "algorithm.clip_ratio_high=0.2", "optim.grad_clip=0", "algorithm.kl_coef=0",
                           f"algorithm.rollout_n={G}"]).config
    eng = FSDPEngine(cfg, str(model_dir), 512, 0, 2, torch.device("cpu"), updates_per_step=1)
    eng.build()
    with torch.no_grad():  # the same weights the batch was sampled from
        eng.model.lm_head.weight[2] += 0.06 * eng.model.model.norm.weight.sign()
    batch.advantages = compute_advantages(cfg.algorithm, rewards, batch.response_mask, G).advantages
    grads = {}
    step = eng.optimizer.step

    def capture(*a, **k):
        for name, p in eng.model.named_parameters():
            grads[name] = p.grad.detach().clone()
        return step(*a, **k)

    eng.optimizer.step = capture
    stats = eng.train_step(batch, PolicyLoss(cfg.algorithm, world))
    return grads, stats.metrics["pg_loss"]


def trl_grad(model, batch, rewards, loss_type, G, work: Path, adv_eps: float):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(work / "trl-out"), per_device_train_batch_size=len(batch), num_generations=G,
                      max_completion_length=int(batch.response_mask.sum(-1).max()), beta=0.0, epsilon=0.2,
                      loss_type=loss_type, scale_rewards="group", use_cpu=True, report_to="none", bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}]))
    P = int(batch.prompt_lengths[0])
    ids, mask = batch.input_ids, batch.response_mask
    grouped = rewards.view(-1, G)
    adv = (rewards - grouped.mean(1).repeat_interleave(G)) / (grouped.std(1).repeat_interleave(G) + adv_eps)
    inputs = {"prompt_ids": ids[:, :P], "prompt_mask": torch.ones_like(ids[:, :P]),
              "completion_ids": ids[:, P:], "completion_mask": mask[:, P:].long(), "advantages": adv,
              "old_per_token_logps": batch.old_log_probs[:, P:], "num_items_in_batch": mask.sum()}
    model.train()
    model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, float(loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/rl-learning")
    ap.add_argument("--json", default="")
    ap.add_argument("--adv-eps", type=float, default=1e-6,
                    help="the epsilon in TRL's advantage (r - mean) / (std + eps): rl's and verl's 1e-6 by default, so "
                         "the comparison is of the update; TRL's own is 1e-4 (~0.3%% on the loss at these rewards)")
    ap.add_argument("--per-tensor", action="store_true", help="each parameter's gradient error (and the embedding's worst rows)")
    args = ap.parse_args()
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from learning import build_job

    from tests.dist_utils import run_ranks

    work = Path(args.work)
    job_dir = build_job(work, "reverse")
    model_dir = work / "model"
    G = 8
    model, batch, rewards, _ = make_batch(model_dir, job_dir, G)
    lengths = batch.response_mask.sum(-1).tolist()
    print(f"batch: {len(batch)} rows, response lengths {sorted(int(x) for x in lengths)}")
    # old log-probs: the sampler's, shifted by a seeded +-0.3 so that the clip bites on some tokens
    noise = (torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(1)) - 0.5) * 0.6
    batch.old_log_probs = (batch.rollout_log_probs + noise) * batch.response_mask
    out = []
    for mode, loss_type in MODES.items():
        (g_rl, loss_rl), = run_ranks(rl_grad, 1, model_dir, batch, rewards, mode, G)
        with tempfile.TemporaryDirectory() as tmp:
            g_trl, loss_trl = trl_grad(model, batch, rewards, loss_type, G, Path(tmp), args.adv_eps)
        names = [n for n in g_trl if n in g_rl]
        num = sum(float((g_rl[n] - g_trl[n]).pow(2).sum()) for n in names) ** 0.5
        den = sum(float(g_trl[n].pow(2).sum()) for n in names) ** 0.5
        cos = sum(float((g_rl[n] * g_trl[n]).sum()) for n in names) / (
            den * sum(float(g_rl[n].pow(2).sum()) for n in names) ** 0.5)
        if args.per_tensor:
            for n in names:
                e = float((g_rl[n] - g_trl[n]).norm() / g_trl[n].norm().clamp(min=1e-30))
                print(f"    {n:50s} rel err {e:.2e}  |g| {float(g_trl[n].norm()):.3e}")
                if "embed" in n:
                    d = (g_rl[n] - g_trl[n]).norm(dim=-1)
                    top = d.topk(5)
                    print("      rows", top.indices.tolist(), [round(float(x), 5) for x in top.values],
                          "rl", [round(float(g_rl[n][i].norm()), 5) for i in top.indices],
                          "trl", [round(float(g_trl[n][i].norm()), 5) for i in top.indices])
        emb = "model.embed_tokens.weight"  # without the pad row (0), which TRL's model never trains
        d_pad = float((g_rl[emb][0] - g_trl[emb][0]).pow(2).sum())
        no_pad = max(num ** 2 - d_pad, 0.0) ** 0.5 / den
        row = {"mode": mode, "trl_loss_type": loss_type, "loss_rl": loss_rl, "loss_trl": loss_trl,
               "grad_rel_err": num / den, "grad_rel_err_without_pad_row": no_pad, "grad_cosine": cos,
               "params": len(names)}
        out.append(row)
        print(f"{mode:20s} vs TRL {loss_type:5s}: loss rl {loss_rl:+.6f} TRL {loss_trl:+.6f}; gradient relative "
              f"error {num / den:.2e} ({no_pad:.2e} without the pad token's embedding row), cosine {cos:.6f} "
              f"({len(names)} tensors)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
