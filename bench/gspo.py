"""GSPO against token-level GRPO on a tiny mixture-of-experts policy: same model, task, seeds and
budget; prints the markdown table of docs/algorithms.md ("GSPO against GRPO").

    python bench/gspo.py                                  # 30 steps, seeds 0 1 2, both losses
    python bench/gspo.py --steps 40 --replay off          # without routing replay
    python bench/gspo.py --out /tmp/gspo.json             # also keep every run's numbers
    python bench/gspo.py --table-from /tmp/gspo.json      # the table of a saved (or partial) run

The policy is a random-init tiny Mixtral (2 layers, 8 experts, top-2, hidden 32; the echo
task's character tokenizer; ``tests/tiny_hf.py``) trained by a real `rl train` (Ray, one gloo rank,
FSDP2, the torch sampler) on the default task, one run at a time. Each RL step's rollout batch
is split into ``--mini-batches`` optimizer steps (the GSPO paper's 4), so every step but the
first of an RL step trains off-policy and the two losses differ:

  grpo   ``algorithm.loss=ppo_clip``: a ratio and a clip per token, 0.2 / 0.28, ``token-mean``
         (rl's GRPO defaults)
  gspo   ``algorithm.loss=gspo``: one ratio per response, clipped to [1 - 3e-4, 1 + 4e-4] (the
         paper's), ``seq-mean-token-mean`` (the paper's aggregation)

Routing replay (``algorithm.router_replay``, docs/moe.md) is on for both by default. Per run:
the mean reward of the first and the last ``--window`` steps, the run's clip fraction (tokens for
grpo, responses for gspo) averaged over steps, and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOSSES = {
    "grpo": ["algorithm.loss=ppo_clip", "algorithm.loss_agg_mode=token-mean"],
    "gspo": ["algorithm.loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean"],
}


def build_model(work: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.tiny_hf import save_tiny_model

    out = work / "tiny-mixtral"
    if not (out / "config.json").exists():
        save_tiny_model("mixtral", out, experts=8)
    return out


def run_one(loss: str, seed: int, args, model: Path, work: Path) -> dict:
    d = work / f"{loss}-{seed}"
    cmd = [sys.executable, "-m", "rlcli.main", "train", f"model.path={model}", *LOSSES[loss],
           f"algorithm.router_replay={args.replay}", f"trainer.seed={seed}", f"trainer.total_steps={args.steps}",
           f"data.train_batch_size={args.prompts}",
           f"algorithm.ppo_mini_batch_size={args.prompts // args.mini_batches}",
           "checkpoint.save_final=false", "checkpoint.save_freq=0", f"checkpoint.dir={d}", "--json", *args.extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{loss} seed {seed} failed:\n{r.stderr[-3000:]}")
    s = json.loads(r.stdout)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [x for x in rows if "reward_mean" in x]
    rewards = [x["reward_mean"] for x in rows]
    w = args.window
    clip = [x["algo"].get("seq_clip_frac", x.get("clip_frac")) for x in rows]
    clip = [c for c in clip if c is not None]
    return {"loss": loss, "seed": seed, "reward_first": statistics.mean(rewards[:w]),
            "reward_last": statistics.mean(rewards[-w:]), "rewards": rewards,
            "clip_frac": statistics.mean(clip) if clip else None, "wall_time_s": s["wall_time_s"],
            "seq_ratio_min": min((x["algo"]["seq_ratio_min"] for x in rows if "seq_ratio_min" in x["algo"]),
                                 default=None),
            "seq_ratio_max": max((x["algo"]["seq_ratio_max"] for x in rows if "seq_ratio_max" in x["algo"]),
                                 default=None)}


def table(results: list[dict], window: int) -> str:
    lines = [f"| loss | reward, first {window} steps (per seed) | reward, last {window} steps (per seed) | "
             f"last / first, median | clip fraction, median | wall time s, median |", "|---|---|---|---|---|---|"]
    for loss in LOSSES:
        rs = sorted((r for r in results if r["loss"] == loss), key=lambda r: r["seed"])
        if not rs:
            continue
        first = [r["reward_first"] for r in rs]
        last = [r["reward_last"] for r in rs]
        gain = statistics.median(b / a if a > 0 else float("inf") for a, b in zip(first, last))
        clips = [r["clip_frac"] for r in rs if r["clip_frac"] is not None]
        lines.append(f"| `{loss}` | {statistics.median(first):.3f} ({', '.join(f'{x:.3f}' for x in first)}) | "
                     f"**{statistics.median(last):.3f}** ({', '.join(f'{x:.3f}' for x in last)}) | {gain:.2f}x | "
                     f"{statistics.median(clips) if clips else float('nan'):.3f} | "
                     f"{statistics.median(r['wall_time_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per RL step (x algorithm.rollout_n samples)")
    ap.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per RL step")
    ap.add_argument("--replay", default="replay", choices=["off", "record", "replay"])
    ap.add_argument("--window", type=int, default=5, help="steps averaged for the first/last reward")
    ap.add_argument("--work", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--table-from", default="", help="print the table of a results file written by --out")
    ap.add_argument("extra", nargs="*", help="more overrides for every run")
    args = ap.parse_args()
    if args.table_from:
        saved = json.loads(Path(args.table_from).read_text())
        print(table(saved["results"], saved["args"]["window"]))
        return
    if args.prompts % args.mini_batches:
        raise SystemExit("--prompts must be a multiple of --mini-batches")
    work = Path(args.work or tempfile.mkdtemp(prefix="rl-gspo-bench-"))
    model = build_model(work)
    results = []
    for seed in args.seeds:
        for loss in args.losses:
            r = run_one(loss, seed, args, model, work)
            results.append(r)
            print(f"  {loss} seed {seed}: reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}, clip "
                  f"{r['clip_frac']}, {r['wall_time_s']:.0f} s", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(table(results, args.window))


if __name__ == "__main__":
    main()
