"""GRPO written from the formulas, in one plain PyTorch loop: the learning suite's third tool.

    OMP_NUM_THREADS=1 python bench/learning.py --tools ref rl trl --jobs sort      # beside rl and TRL
    OMP_NUM_THREADS=1 python bench/learning.py --tools ref --ref-sampler hf       # HF generate samples

rl and TRL are both large programs; when they learn differently, this loop says which of them
differs from the algorithm on paper. One process, a Hugging Face model, no rl trainer code:

- prompts: the order rl documents (docs/data.md): the prompt file shuffled by the seed, then each
  epoch's shuffle, ``prompts`` a step;
- sampling: rl's sampler (``sampler="rl"``: engine/rollout/torch_sampler.py, from the generator rl
  seeds for rank 0; its distribution is tests/test_sampling_parity.py's subject) or Hugging Face
  ``generate`` (``"hf"``, TRL's sampler), temperature 1, no top-p or top-k;
- reward: the job's ``score`` on the response decoded up to its EOS;
- advantages: ``(r - mean(group)) / (std(group, Bessel) + adv_eps)``;
- loss: PPO-clip (0.2) with one update per batch (the ratio is 1), averaged over every response
  token of the batch (token-mean: rl's default, TRL's ``dapo``);
- AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), constant learning rate, gradient norm
  clipped to 1.0;
- the pad token's input embedding trains when the policy samples it (``train_pad_row``: rl's
  semantics, engine/model/build.py) or stays frozen (Hugging Face's ``padding_idx``, TRL's).

tests/test_trajectory_parity.py checks that ``rl train``'s first steps equal this loop's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

PAD, EOS = 0, 2  # bench/learning.py's tokenizer


def reference_run(job_dir: Path, model_dir: Path, seed: int, steps: int, *, lr: float, new_tokens: int,
                  prompts: int = 8, samples: int = 8, sampler: str = "rl", train_pad_row: bool = True,
                  adv_eps: float = 1e-6, keep_model: bool = False, step_rows: list[list[dict]] | None = None,
                  generator_seed: int | None = None, left_pad_prompts: bool = False):
    """Per step: reward_mean, response_len_mean (tokens, EOS included), grad_norm (before clipping),
    entropy (token mean), step_s. With ``keep_model`` also returns the trained model. ``step_rows``:
    each step's prompt rows instead of rl's order (to replay another trainer's batches);
    ``generator_seed``: rl's sampler's generator (default: rank 0's in rl, ``seed * 7919``)."""
    import torch
    from transformers import AutoTokenizer

    from engine.config.schema import RolloutConfig
    from engine.rollout.torch_sampler import TorchSampler

    sys.path.insert(0, str(job_dir))
    from learning_reward import score

    tok = AutoTokenizer.from_pretrained(model_dir)
    model, opt = policy_and_optimizer(model_dir, lr, train_pad_row)
    rows, order = rl_prompt_order(job_dir, seed, steps * prompts)
    rl_sampler = TorchSampler(RolloutConfig(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0), PAD, EOS,
                              torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed * 7919 if generator_seed is None else generator_seed)  # rl rank 0's
    torch.manual_seed(seed)  # HF generate draws from the global generator
    out = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = step_rows[step] if step_rows is not None else [rows[i] for i in order[step * prompts:(step + 1) * prompts]]
        ids_p = [tok.encode(r["prompt"], add_special_tokens=False) for r in batch]
        model.eval()
        seqs = sample_with_rl(rl_sampler, model, ids_p, samples, generator) if sampler == "rl" else \
            _sample_hf(model, ids_p, samples, new_tokens)
        answers = [r["answer"] for r in batch for _ in range(samples)]
        rewards = torch.tensor([score(tok.decode(r[:r.index(EOS)] if EOS in r else r, skip_special_tokens=True), a)
                                for (_, r), a in zip(seqs, answers)])
        g = rewards.view(prompts, samples)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + adv_eps)).reshape(-1)
        ids, attn, resp = right_padded(seqs, PAD, left_pad_prompts)
        model.train()
        logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = resp[:, 1:]
        ratio = torch.exp(logp - logp.detach())  # one update per batch: old policy = current
        a = adv[:, None]
        loss = -(torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) * mask).sum() / mask.sum()
        with torch.no_grad():
            entropy = float((-(logp_all.exp() * logp_all).sum(-1) * mask).sum() / mask.sum())
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        out.append({"reward_mean": float(rewards.mean()), "response_len_mean": sum(len(r) for _, r in seqs) / len(seqs),
                    "grad_norm": norm, "entropy": entropy, "step_s": time.perf_counter() - t0})
    return (out, model) if keep_model else out


def policy_and_optimizer(model_dir: Path, lr: float, train_pad_row: bool = True):
    """The Hugging Face model and its AdamW (betas 0.9/0.999, eps 1e-8, no weight decay)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if train_pad_row:
        model.get_input_embeddings().padding_idx = None
    return model, torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def rl_prompt_order(job_dir: Path, seed: int, count: int) -> tuple[list[dict], list[int]]:
    """The job's prompt rows as rl's train split holds them (the file shuffled by the run seed) and
    the indices of at least ``count`` prompts in the order rl trains them: epoch e walks
    random.Random(seed * 1_000_003 + e)'s shuffle (docs/data.md)."""
    rows = [json.loads(x) for x in (job_dir / "train.jsonl").read_text().splitlines() if x.strip()]
    split = list(range(len(rows)))
    random.Random(seed).shuffle(split)
    rows = [rows[i] for i in split]
    order = []
    for epoch in range(-(-count // len(rows))):
        ix = list(range(len(rows)))
        random.Random(seed * 1_000_003 + epoch).shuffle(ix)
        order += ix
    return rows, order


def right_padded(rows: list[tuple[list[int], list[int]]], pad: int, left_pad_prompts: bool = False):
    """(prompt ids, response ids) rows -> ids, attention mask and response mask [B, T]: each row's
    prompt then response from position 0, right-padded with ``pad``. ``left_pad_prompts``: TRL's
    layout instead, prompts left-padded to the longest, responses after them."""
    import torch

    P = max(len(p) for p, _ in rows) if left_pad_prompts else 0
    T = max((P or len(p)) + len(r) for p, r in rows)
    ids = torch.full((len(rows), T), pad)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    resp = torch.zeros((len(rows), T))
    for i, (p, r) in enumerate(rows):
        s = P - len(p) if left_pad_prompts else 0
        ids[i, s:s + len(p) + len(r)] = torch.tensor(p + r)
        attn[i, s:s + len(p) + len(r)] = 1
        resp[i, s + len(p):s + len(p) + len(r)] = 1
    return ids, attn, resp


def sample_with_rl(sampler, model, prompts, n, generator):
    """(prompt ids, response ids up to and with EOS) per row, from rl's sampler."""
    b = sampler.generate(model, prompts, n, generator)
    seqs = []
    for i in range(len(b.input_ids)):
        ids, total, m = b.input_ids[i].tolist(), int(b.attention_mask[i].sum()), int(b.response_mask[i].sum())
        seqs.append((ids[:total - m], ids[total - m:total]))
    return seqs


def _sample_hf(model, prompts, n, new_tokens):
    """The same from Hugging Face ``generate`` (left-padded prompts), as TRL samples."""
    import torch

    rows = [p for p in prompts for _ in range(n)]
    L = max(map(len, rows))
    ids = torch.tensor([[PAD] * (L - len(p)) + p for p in rows])
    attn = (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in rows])[:, None]).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, do_sample=True,
                             top_k=0, top_p=1.0, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD)
    seqs = []
    for p, o in zip(rows, out[:, L:].tolist()):
        seqs.append((p, o[:o.index(EOS) + 1] if EOS in o else o))
    return seqs


def main() -> None:
    """bench/learning.py's worker: one run, its series and held-out accuracy to ``--result``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--sampler", default="rl", choices=["rl", "hf"])
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    import os

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from learning import greedy_accuracy

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job_dir = Path(args.job_dir)
    rows, model = reference_run(job_dir, job_dir.parent / "model", args.seed, args.steps, lr=args.lr,
                                new_tokens=args.new_tokens, sampler=args.sampler, keep_model=True)
    acc = greedy_accuracy(model, job_dir, torch.get_num_threads())
    Path(args.result).write_text(json.dumps({
        "reward": [r["reward_mean"] for r in rows], "length": [r["response_len_mean"] for r in rows],
        "entropy": [r["entropy"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
        "step_s": [r["step_s"] for r in rows], "heldout_acc": acc}))


if __name__ == "__main__":
    main()
