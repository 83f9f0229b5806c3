"""GRPO from the formulas with one-step-off sampling, and off-policy treatments of the stale batch.

    OMP_NUM_THREADS=1 python bench/delayed_grpo.py --jobs copy --seeds 0 1 2 3 4 5 6 \\
        --variants sync behavior snis snis_baseline snis_masked --parallel 2

Is one_step_off's lag (docs/async.md) rl's doing or the delay's? This is bench/reference_grpo.py's
plain loop (same model, prompt order, sampler, reward, AdamW, clipping) with the batch of step k+1
sampled by the weights *before* step k's update, as rl's rollout worker samples it, and these
treatments of that one-version-stale batch (``b`` = the sampling weights, ``theta`` = the weights at
the update, ``w_i = pi_theta(y_i) / pi_b(y_i)`` a response's sequence ratio):

- ``sync``: no delay (the reference loop itself, drawing from rank 0's stream: ``seed * 7919``);
- ``sync_rs``: no delay, drawing from the rollout worker's stream, as every delayed variant does:
  ``behavior`` against ``sync_rs`` is the delay alone, seed for seed (against ``sync`` it is the
  delay plus another stream, and at 7 seeds the stream alone can look like a lag);
- ``behavior``: rl's default: PPO's ratio against pi_b, clipped per version to 0.8^2 .. 1.2^2;
- ``snis``: self-normalised importance sampling per prompt group: weights ``G w_i / sum_j w_j``
  give the group's baseline and std (estimates of the value under pi_theta, not pi_b) and weigh
  each response's gradient; the ratio is against theta (no clip at one update);
- ``snis_baseline``: only the baseline and std from those weights, with ``behavior``'s loss;
- ``snis_masked``: ``snis`` with ``behavior``'s trust region: tokens whose ratio to pi_b is past
  the per-version bounds in the advantage's direction get no gradient;
- ``predicted``: ``behavior``'s loss, but the stale batch is sampled by the weights the update is
  predicted to reach: the current weights plus the last update again (``2 theta_k - theta_{k-1}``,
  weight prediction as SpecTrain does for pipeline staleness); pi_b is that prediction;
- ``ratio_only``: each token's ratio to pi_b, no trust region (decoupled PPO at one update, untruncated);
- ``decoupled``: the same with the ratio truncated at TIS_CAP and used as a weight (AReaL's
  decoupled loss at one update with truncated importance sampling);
- ``as_fresh``: no correction (the stale batch's gradient as if theta had sampled it);
- ``stale_once``: ``behavior`` for step 1's batch only, then on-policy (is the lag made early?).

The first step trains on a fresh batch (staleness 0), as in rl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from reference_grpo import EOS, PAD, policy_and_optimizer, right_padded, rl_prompt_order, sample_with_rl  # noqa: E402

VARIANTS = ("sync", "behavior", "snis", "snis_baseline", "snis_masked", "predicted", "ratio_only", "as_fresh", "decoupled", "stale_once", "sync_rs")
CLIP = 0.2
TIS_CAP = 2.0
LR = 1e-3  # the learning suite's (bench/learning.py)


def delayed_run(job_dir: Path, model_dir: Path, seed: int, steps: int, variant: str, *, lr: float = LR,
                new_tokens: int = 32, prompts: int = 8, samples: int = 8) -> list[dict]:
    """Per step: reward_mean, response_len_mean, entropy, grad_norm, kl_to_sampler (k3, token mean),
    clip_frac, ess (the groups' mean effective sample size under the snis weights).

    Every batch is drawn from the generator rl seeds for the run's sampler: rank 0's in sync mode,
    the rollout worker's when sampling ahead (it samples step 1's batch too), so ``behavior`` is
    ``rl train trainer.mode=one_step_off`` step for step (tests/test_trajectory_parity.py)."""
    import torch
    from transformers import AutoTokenizer

    from engine.config.schema import RolloutConfig
    from engine.rollout.torch_sampler import TorchSampler
    from engine.trainer.rollout_worker import rollout_seed

    sys.path.insert(0, str(job_dir))
    from learning_reward import score

    tok = AutoTokenizer.from_pretrained(model_dir)
    model, opt = policy_and_optimizer(model_dir, lr)  # the pad row trains when sampled, as in rl
    rows, order = rl_prompt_order(job_dir, seed, (steps + 1) * prompts)  # one batch past the last step
    sampler = TorchSampler(RolloutConfig(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0), PAD, EOS,
                           torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed * 7919 if variant == "sync" else rollout_seed(seed))
    fresh = variant in ("sync", "sync_rs")

    def draw(step: int, stale: int) -> dict:
        batch = [rows[i] for i in order[step * prompts:(step + 1) * prompts]]
        model.eval()
        seqs = sample_with_rl(sampler, model, [tok.encode(r["prompt"], add_special_tokens=False) for r in batch],
                              samples, generator)
        ids, attn, resp = right_padded(seqs, PAD)
        with torch.no_grad():  # the sampling weights' log-probs (rl's sampler keeps its own; equal to ~1e-6)
            lp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)
        answers = [r["answer"] for r in batch for _ in range(samples)]
        rewards = torch.tensor([score(tok.decode(r[:r.index(EOS)] if EOS in r else r, skip_special_tokens=True), a)
                                for (_, r), a in zip(seqs, answers)])
        return {"seqs": seqs, "ids": ids, "attn": attn, "mask": resp[:, 1:], "stale": stale, "rewards": rewards,
                "sampler_logp": lp.gather(-1, ids[:, 1:, None]).squeeze(-1)}

    out, ahead, before = [], None, None
    for step in range(steps):
        cur = draw(step, 0) if fresh or ahead is None else ahead
        if variant == "stale_once" and step >= 1:  # one stale batch (step 1's), then on-policy
            fresh, ahead = True, None
        if variant == "predicted" and before is not None:  # sample with theta + (theta - theta_before)
            now = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p, b in zip(model.parameters(), before):
                    p.mul_(2).sub_(b)
            ahead = draw(step + 1, 1)
            with torch.no_grad():
                for p, n in zip(model.parameters(), now):
                    p.copy_(n)
        elif not fresh:  # the next batch, from the weights before this update
            ahead = draw(step + 1, 1)
        if variant == "predicted":
            before = [p.detach().clone() for p in model.parameters()]
        model.train()
        logp_all = torch.log_softmax(model(input_ids=cur["ids"], attention_mask=cur["attn"]).logits[:, :-1].float(), -1)
        logp = logp_all.gather(-1, cur["ids"][:, 1:, None]).squeeze(-1)
        loss, info = stale_batch_loss(variant, logp, cur, prompts, samples)
        mask = cur["mask"]
        with torch.no_grad():
            entropy = float((-(logp_all.exp() * logp_all).sum(-1) * mask).sum() / mask.sum())
            d = cur["sampler_logp"] - logp
            kl = float(((torch.exp(d) - d - 1) * mask).sum() / mask.sum())
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        out.append({"reward_mean": float(cur["rewards"].mean()), "entropy": entropy, "grad_norm": norm,
                    "response_len_mean": sum(len(r) for _, r in cur["seqs"]) / len(cur["seqs"]),
                    "kl_to_sampler": kl, **info})
    return out


def stale_batch_loss(variant: str, logp, cur: dict, prompts: int, samples: int):
    """The variant's loss on one batch (token-mean over the batch's response tokens) and its metrics."""
    import torch

    mask, g = cur["mask"], cur["rewards"].view(prompts, samples)
    stale = cur["stale"] and variant not in ("sync", "sync_rs")
    if stale:  # ratio to the sampling weights; PPO's bounds compound per version (rl's per_version)
        to_sampler, lo, hi = torch.exp(logp - cur["sampler_logp"]), (1 - CLIP) ** 2, (1 + CLIP) ** 2
    else:
        to_sampler, lo, hi = torch.exp(logp - logp.detach()), 1 - CLIP, 1 + CLIP
    with torch.no_grad():
        log_w = ((logp.detach() - cur["sampler_logp"]) * mask).sum(-1) if stale else torch.zeros(len(mask))
        w = torch.softmax(log_w.view(prompts, samples), 1) * samples  # self-normalised: sums to G per group
        info = {"ess": float((w.sum(1) ** 2 / (w ** 2).sum(1)).mean())}
        if variant in ("snis", "snis_baseline", "snis_masked"):
            base = (w * g).sum(1, keepdim=True) / samples
            std = ((w * (g - base) ** 2).sum(1, keepdim=True) / (samples - 1)).sqrt()
        else:
            base, std = g.mean(1, keepdim=True), g.std(1, keepdim=True)
        adv = ((g - base) / (std + 1e-6)).reshape(-1)[:, None]
    if variant == "ratio_only":  # per-token importance ratio to pi_b, no trust region (decoupled PPO at one update)
        info["clip_frac"] = 0.0
        return -(to_sampler * adv * mask).sum() / mask.sum(), info
    if variant == "decoupled":  # AReaL's decoupled PPO at one update: ratio to the proximal (theta) = 1,
        # each token weighted by its importance ratio pi_theta / pi_b, truncated at TIS_CAP (no trust-region mask)
        weight = to_sampler.detach().clamp(max=TIS_CAP)
        info["clip_frac"] = float(((to_sampler.detach() > TIS_CAP).float() * mask).sum() / mask.sum())
        return -(weight * torch.exp(logp - logp.detach()) * adv * mask).sum() / mask.sum(), info
    if variant == "as_fresh":  # no correction: the stale batch's gradient as if theta had sampled it
        info["clip_frac"] = 0.0
        return -(torch.exp(logp - logp.detach()) * adv * mask).sum() / mask.sum(), info
    if variant in ("sync", "sync_rs", "behavior", "snis_baseline", "stale_once"):
        clipped = to_sampler.clamp(lo, hi) * adv
        per_token = torch.minimum(to_sampler * adv, clipped)
        info["clip_frac"] = float((((to_sampler * adv) > clipped).float() * mask).sum() / mask.sum())
        return -(per_token * mask).sum() / mask.sum(), info
    keep = torch.ones_like(mask)
    if variant == "snis_masked":
        keep = (~(((adv > 0) & (to_sampler > hi)) | ((adv < 0) & (to_sampler < lo)))).float()
    info["clip_frac"] = float(((1 - keep) * mask).sum() / mask.sum())
    weight = w.reshape(-1)[:, None]
    ratio = torch.exp(logp - logp.detach())  # against theta: gradient = grad log pi
    return -(ratio * weight * adv * keep * mask).sum() / (weight * mask).sum(), info


def _one(job: str, variant: str, seed: int, work: Path, steps: int, out_dir: Path, lr: float) -> dict:
    out = out_dir / f"{job}_{variant}_{seed}{_lr_tag(lr)}.json"
    if not out.exists():
        cmd = [sys.executable, __file__, "--worker", "--jobs", job, "--variants", variant, "--seeds", str(seed),
               "--steps", str(steps), "--work", str(work), "--out-dir", str(out_dir), "--lr", str(lr)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return {"job": job, "variant": variant, "seed": seed, "steps": json.loads(out.read_text())}


def _lr_tag(lr: float) -> str:
    return "" if lr == LR else f"_lr{lr:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", nargs="+", default=["copy"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=LR, help="AdamW's learning rate (the learning suite's by default)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (each on OMP_NUM_THREADS threads)")
    ap.add_argument("--work", default="/tmp/rl-learning", help="bench/learning.py's jobs and model")
    ap.add_argument("--out-dir", default="/tmp/rl-delayed-grpo", help="one JSON per run; an existing one is reused")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from learning import build_job, stop_step

    work, out_dir = Path(args.work), Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.worker:
        import os

        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        job, variant, seed = args.jobs[0], args.variants[0], args.seeds[0]
        t = time.perf_counter()
        steps = delayed_run(build_job(work, job), work / "model", seed, args.steps, variant, lr=args.lr)
        steps[-1]["run_s"] = time.perf_counter() - t
        (out_dir / f"{job}_{variant}_{seed}{_lr_tag(args.lr)}.json").write_text(json.dumps(steps))
        return
    todo = [(j, v, s) for j in args.jobs for v in args.variants for s in args.seeds]
    for j in args.jobs:
        build_job(work, j)
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda a: _one(*a, work, args.steps, out_dir, args.lr), todo))
    print(f"{'job':6s} {'variant':14s} {'mean last-10':>12s} {'median':>7s}  stop steps; last-10 reward per seed")
    for j in args.jobs:
        for v in args.variants:
            rs = [r for r in runs if r["job"] == j and r["variant"] == v]
            last = [statistics.mean(x["reward_mean"] for x in r["steps"][-10:]) for r in rs]
            stops = [stop_step([x["response_len_mean"] for x in r["steps"]], 10.0) for r in rs]
            print(f"{j:6s} {v:14s} {statistics.mean(last):12.3f} {statistics.median(last):7.3f}  "
                  f"{' '.join(str(s) if s else '-' for s in stops)}; {' '.join(f'{x:.3f}' for x in last)}")


if __name__ == "__main__":
    main()
