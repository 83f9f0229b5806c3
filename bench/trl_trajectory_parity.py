"""TRL's GRPOTrainer step for step against GRPO from the formulas (bench/reference_grpo.py).

    OMP_NUM_THREADS=1 python bench/trl_trajectory_parity.py --job sort --steps 8 [--left-pad-prompts]

TRL's generation is replaced by rl's sampler with a fixed generator (drawing from TRL's live
model), so both sides sample from the same stream; the loop then replays TRL's prompts with TRL's
semantics (the pad token's input row frozen, advantages over ``std + 1e-4``). Printed per step:
TRL's logged reward, length, pre-clip gradient norm and the loop's beside them.

Measured (2026-12-05, `sort`, docs/benchmarks.md "Is the synchronous trainer behind TRL?"): the
same samples and rewards for 3 steps; gradient norms equal at step 1 (1.086250), then apart by
5.2e-6 at step 2 (with TRL's layout, `--left-pad-prompts`; 2.8e-5 without), 2.8e-4 at step 3 and
7.8e-3 at step 4, where the samples part. After step 1, TRL's weights and the loop's differ in
4-84 entries of each tensor of 65-176k (up to 5e-5 against updates of 1e-3): the entries whose
gradients are near zero, where Adam's first step (about lr * g / |g|) turns rounding into whole
updates. A different learning rate, epsilon, clip or loss would move every entry. So TRL's
trainer is the formulas up to rounding, as rl's is (rl's layout rounds like the loop's: 7e-7 over
four steps, tests/test_trajectory_parity.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", default="sort")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--work", default="/tmp/rl-learning")
    ap.add_argument("--left-pad-prompts", action="store_true", help="the loop in TRL's layout (prompts left-padded)")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from engine.config.schema import RolloutConfig
    from engine.rollout.torch_sampler import TorchSampler
    from learning import LR, NEW_TOKENS, PROMPTS, SAMPLES, build_job
    from reference_grpo import EOS, PAD, reference_run, sample_with_rl
    from trl_steps import step_recorder

    torch.set_num_threads(1)
    job_dir = build_job(Path(args.work), args.job)
    model_dir = Path(args.work) / "model"
    sys.path.insert(0, str(job_dir))
    from learning_reward import trl_reward

    rows = [json.loads(x) for x in (job_dir / "train.jsonl").read_text().splitlines() if x.strip()]
    tok = AutoTokenizer.from_pretrained(model_dir)
    gen_seed = 1234
    sampler = TorchSampler(RolloutConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0), PAD, EOS,
                           torch.device("cpu"))
    generator = torch.Generator().manual_seed(gen_seed)
    prompts_seen: list[list[str]] = []

    def generate_with_rl_sampler(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        uniq = [list(p) for p in prompt_ids[::num_generations]]
        prompts_seen.append([tok.decode(p) for p in uniq])
        training = self.model.training
        self.model.eval()
        seqs = sample_with_rl(sampler, self.model, uniq, num_generations, generator)
        self.model.train(training)
        return [response for _, response in seqs], None

    GRPOTrainer._generate_single_turn = generate_with_rl_sampler
    logs: list = []
    out_dir = tempfile.mkdtemp(prefix="trl-traj-")
    cfg = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, max_completion_length=NEW_TOKENS, max_steps=args.steps, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        max_grad_norm=1.0, optim="adamw_torch", beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=trl_reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[step_recorder([], logs)])
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    by_prompt = {r["prompt"]: r for r in rows}
    ref = reference_run(job_dir, model_dir, 0, args.steps, lr=LR, new_tokens=NEW_TOKENS, sampler="rl",
                        train_pad_row=False, adv_eps=1e-4, step_rows=[[by_prompt[p] for p in ps] for ps in prompts_seen],
                        generator_seed=gen_seed, left_pad_prompts=args.left_pad_prompts)
    print(f"{'step':>4s} {'TRL reward':>11s} {'loop':>9s} {'TRL len':>8s} {'loop':>7s} {'TRL grad norm':>14s} "
          f"{'loop':>10s} {'rel diff':>9s}")
    for k, (lg, r) in enumerate(zip(logs, ref), 1):
        rel = abs(lg["grad_norm"] - r["grad_norm"]) / r["grad_norm"]
        print(f"{k:4d} {lg['reward']:11.6f} {r['reward_mean']:9.6f} {lg['completions/mean_length']:8.3f} "
              f"{r['response_len_mean']:7.3f} {lg['grad_norm']:14.6f} {r['grad_norm']:10.6f} {rel:9.1e}")


if __name__ == "__main__":
    main()
