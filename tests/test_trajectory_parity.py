"""`rl train`'s first steps are GRPO written from the formulas, step after step: a whole run, not
one update.

tests/test_update_parity.py checks one update on a fixed batch; tests/test_sampling_parity.py
checks what the sampler draws. What neither sees is how the steps compose: the optimizer's state
carried from step to step, the learning-rate schedule, the prompt order, the rewards computed from
the decoded responses, each group's advantages, and the sampler reading the weights the last update
wrote. Here a real ``rl train`` (FSDP2 on one gloo rank, in a Ray actor) runs four steps of
bench/learning.py's ``count`` job, and a plain loop written in this file runs the same four steps:
Hugging Face model, AdamW, gradient clipping, GRPO's group-normalised advantages, the token-mean
PPO-clip loss, and the prompt order rl documents (its run seed shuffles the prompt file, then each
epoch's order: docs/data.md). The reference draws with rl's sampler on its own copy of the weights
(the sampler's distribution is the other test's subject), from the generator rl seeds for rank 0.
So if any step of rl's trainer differed from the formulas, the weights would differ after it, and
every later batch, reward and gradient with them.

Measured when written (2026-12-05): rewards and lengths equal, pre-clip gradient norms and entropies
within 7e-7 relative over the four steps (hence the 2e-5 tolerance). Sensitivity: rl with AdamW's
beta2 at 0.99 instead of the reference's 0.999 gives the same samples for four steps but gradient
norms off by 8e-5 at step 3 and 4.5e-3 at step 4. The 3.4M-parameter ``count`` job of
bench/learning.py agreed over its first 3 steps the same way (docs/benchmarks.md, "Learning").
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIZE = (128, 2, 4, 344, 128)  # hidden, layers, heads, intermediate, vocabulary (tests/test_learning.py's)
STEPS, NEW_TOKENS, LR, SEED = 4, 16, 3e-3, 3
PROMPTS, SAMPLES, PAD, EOS = 8, 8, 0, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    pytest.importorskip("tokenizers")
    sys.path.insert(0, str(ROOT))
    from bench.learning import build_job

    work = tmp_path_factory.mktemp("trajectory")
    return work, build_job(work, "count", SIZE)


def rl_steps(work: Path, job_dir: Path, run_dir: Path) -> list[dict]:
    from bench.learning import rl_overrides

    cmd = [sys.executable, "-m", "rlcli.main", "train",
           *rl_overrides(job_dir, work / "model", SEED, STEPS, loss="token-mean", new_tokens=NEW_TOKENS),
           f"optim.lr={LR}", "trainer.threads_per_rank=1", "checkpoint.save_final=false", f"checkpoint.dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=job_dir, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def reference_steps(work: Path, job_dir: Path) -> list[dict]:
    """The same run from the formulas (one process, plain PyTorch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config.schema import RolloutConfig
    from engine.rollout.torch_sampler import TorchSampler

    sys.path.insert(0, str(job_dir))
    from learning_reward import score

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    model.get_input_embeddings().padding_idx = None  # a sampled pad is a real token in rl (its row trains)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rows = [json.loads(x) for x in (job_dir / "train.jsonl").read_text().splitlines() if x.strip()]
    split = list(range(len(rows)))
    random.Random(SEED).shuffle(split)       # the train split: the file shuffled by the run seed
    rows = [rows[i] for i in split]
    order = list(range(len(rows)))
    random.Random(SEED * 1_000_003).shuffle(order)  # epoch 0's prompt order
    sampler = TorchSampler(RolloutConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0), PAD, EOS,
                           torch.device("cpu"))
    generator = torch.Generator().manual_seed(SEED * 7919)  # rank 0's sampling generator
    out = []
    for step in range(STEPS):
        batch = [rows[i] for i in order[step * PROMPTS:(step + 1) * PROMPTS]]
        prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in batch]
        model.eval()
        sampled = sampler.generate(model, prompts, SAMPLES, generator)
        seqs = []  # (prompt ids, response ids up to and with EOS)
        for i in range(len(sampled.input_ids)):
            ids, n = sampled.input_ids[i].tolist(), int(sampled.attention_mask[i].sum())
            m = int(sampled.response_mask[i].sum())
            seqs.append((ids[:n - m], ids[n - m:n]))
        answers = [r["answer"] for r in batch for _ in range(SAMPLES)]
        rewards = torch.tensor([score(tok.decode(r[:r.index(EOS)] if EOS in r else r, skip_special_tokens=True), a)
                                for (_, r), a in zip(seqs, answers)])
        # GRPO: A_i = (r_i - mean(group)) / (std(group, Bessel) + 1e-6)
        g = rewards.view(PROMPTS, SAMPLES)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).reshape(-1)
        T = max(len(p) + len(r) for p, r in seqs)
        ids = torch.full((len(seqs), T), PAD)
        attn = torch.zeros((len(seqs), T), dtype=torch.long)
        resp = torch.zeros((len(seqs), T))
        for i, (p, r) in enumerate(seqs):
            ids[i, :len(p) + len(r)] = torch.tensor(p + r)
            attn[i, :len(p) + len(r)] = 1
            resp[i, len(p):len(p) + len(r)] = 1
        model.train()
        logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = resp[:, 1:]
        # PPO-clip, token-mean over every response token of the batch; one update per batch, so the
        # old policy is the current one (ratio 1, nothing clipped)
        ratio = torch.exp(logp - logp.detach())
        a = adv[:, None]
        loss = -(torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) * mask).sum() / mask.sum()
        with torch.no_grad():
            entropy = float((-(logp_all.exp() * logp_all).sum(-1) * mask).sum() / mask.sum())
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        out.append({"reward_mean": float(rewards.mean()), "response_len_mean": sum(len(r) for _, r in seqs) / len(seqs),
                    "grad_norm": norm, "entropy": entropy})
    return out


def test_rl_train_steps_equal_grpo_from_the_formulas(job, tmp_path):
    import torch

    work, job_dir = job
    got = rl_steps(work, job_dir, tmp_path / "run")
    threads = torch.get_num_threads()
    try:
        want = reference_steps(work, job_dir)  # at one thread, as rl's rank
    finally:
        torch.set_num_threads(threads)  # the rest of this test worker's tests keep theirs
    assert len(got) == STEPS
    assert want[0]["response_len_mean"] > 8, "the start must have long responses and spread rewards"
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g["response_len_mean"] == w["response_len_mean"], f"step {step}: other responses were sampled"
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], abs=1e-6), f"step {step}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=2e-5), f"step {step}: {g['grad_norm']} vs {w['grad_norm']}"
        assert g["entropy"] == pytest.approx(w["entropy"], rel=2e-5), f"step {step}"
    # the steps moved the policy: the later batches are the updated weights' (not the first step's again)
    assert len({round(w["grad_norm"], 6) for w in want}) == STEPS
