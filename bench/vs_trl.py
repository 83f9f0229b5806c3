"""`rl train` vs TRL's GRPOTrainer on the same GRPO job, whole processes back to back.

    OMP_NUM_THREADS=2 python bench/vs_trl.py                      # 3 shapes, 3 repeats, 12 steps each
    OMP_NUM_THREADS=2 python bench/vs_trl.py --shapes base --repeats 3 --steps 20 --json out.json

Both tools load the same directory: a Llama built offline (random init, fp32) and saved with
``save_pretrained``, plus a byte-level BPE tokenizer trained with ``tokenizers`` on the prompts.
Same prompts (a JSONL file / a ``datasets.Dataset``), same reward (a module written into the work
directory: the fraction of response characters that occur in the prompt), same batch (P prompts x
G samples, exactly N new tokens: ``rollout.ignore_eos=true`` on rl, ``min_new_tokens=N`` on TRL,
both of which forbid EOS), temperature 1, top-p 1, AdamW (lr 1e-5, betas 0.9/0.99, no weight decay,
constant LR, grad clip 1.0), no KL (TRL ``beta=0`` loads no reference), one optimizer step per
RL step, no gradient checkpointing (TRL's default is on; off here, which only helps TRL), fp32,
the same thread count, and (unless ``--trl-omp-default``) the OpenMP waits rl's ranks get
(``trainer.omp_wait=auto``: a ~150 us spin, then sleep, on a machine with free cores; passive
waits on a busy one), so neither tool spins on a loaded machine and both spin briefly on a quiet one. rl's ranks keep the host
memory a step frees (``trainer.keep_host_heap``, engine/host_heap.py); ``--trl-heap-tuned`` gives TRL
the same glibc malloc thresholds (``GLIBC_TUNABLES``), to show what that setting alone is worth.

Per shape the two tools run alternately (``trl, rl, rl, trl, trl, rl``, so neither always goes
first) and each figure is the median over repeats of the per-process median step time (first
``--warmup`` steps dropped). Reported: s/step, generated tokens/s (response tokens / step time),
update tokens/s (prompt+response tokens through forward+backward / step time), the FLOP bound
(one step's matmul FLOPs -- generation forward, update forward+backward -- over the best fp32
matmul peak measured in the same run, of MKL's ``a @ b`` and oneDNN's) and the ratios. The load average is printed with every figure.
Beside the speed, what each tool learnt in those steps: the reward at the first step and the mean over the
last half of the steps, and the mean completion length (a faster step that learns less is not faster; with
both tools forbidding EOS here, every completion is N tokens, so learning to stop is bench/learning.py's job).
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

# name -> (hidden, layers, heads, intermediate, vocab, prompts, samples, new tokens)
SHAPES = {
    "base": (256, 4, 4, 688, 512, 8, 8, 32),      # 3.4M params: the issue's job
    "bigger": (512, 8, 8, 1376, 512, 8, 8, 32),   # 25.5M params
    "longer": (256, 4, 4, 688, 512, 8, 8, 128),   # 3.4M params, 4x longer responses
}
PROMPT_WORDS = 6
LR = 1e-5

REWARD_MODULE = '''"""Reward shared by both tools: fraction of response characters that occur in the prompt."""


def score(prompt, response):
    if not response:
        return 0.0
    chars = set(prompt)
    return sum(c in chars for c in response) / len(response)


def rl_reward(prompt, response, answer):
    return score(prompt, response)


def trl_reward(prompts, completions, **kwargs):
    return [score(p, c) for p, c in zip(prompts, completions)]
'''


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 6))) for _ in range(PROMPT_WORDS))
            for _ in range(n)]


def build_job(work: Path, shape: str, num_prompts: int = 256) -> Path:
    """Model dir (weights + tokenizer), prompts.jsonl and the reward module under ``work``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, layers, heads, inter, vocab, *_ = SHAPES[shape]
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(num_prompts)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts))
    (work / "vstrl_reward.py").write_text(REWARD_MODULE)
    model_dir = work / f"model-{shape}"
    if (model_dir / "config.json").exists():
        return model_dir
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_prompts(4096, seed=1), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    hf_tok.save_pretrained(model_dir)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                      pad_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    return model_dir


def model_facts(model_dir: Path) -> dict:
    """Parameter counts and the prompt token lengths (for FLOP counts)."""
    from transformers import AutoConfig, AutoTokenizer

    c = AutoConfig.from_pretrained(model_dir)
    h, inter, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    params = L * per_layer + 2 * V * h + h
    matmul = L * (4 * h * h + 3 * h * inter) + V * h  # the input embedding is a lookup
    tok = AutoTokenizer.from_pretrained(model_dir)
    lens = [len(tok.encode(p, add_special_tokens=False)) for p in make_prompts(256)]
    return {"params": params, "matmul_params": matmul, "layers": L, "hidden": h,
            "prompt_len_mean": sum(lens) / len(lens)}


def step_flops(facts: dict, rows: int, new_tokens: int) -> dict:
    """Matmul FLOPs of one step: linear layers (2 per param per token) plus attention scores
    (QK^T and AV: 4 * hidden per layer per attended pair), generation forward and update fwd+bwd."""
    P, N, h, L = facts["prompt_len_mean"], new_tokens, facts["hidden"], facts["layers"]
    T = P + N
    lin = 2 * facts["matmul_params"] * rows * T
    attn = 4 * h * L * rows * T * T / 2  # causal: about half the pairs
    gen = lin + attn    # prefill + decode with a KV cache sees each token once
    update = 3 * (lin + attn)
    return {"gen": gen, "update": update, "total": gen + update}


def matmul_peak_flops(threads: int, n: int = 1024, seconds: float = 1.5) -> dict:
    """fp32 n^3 matmul rate of each GEMM library this torch has: ``aten`` (``a @ b``: MKL on x86)
    and ``onednn`` (oneDNN, which ``rl`` uses on a CPU: engine.cpu_matmul), and ``best``, the
    machine's peak that the bound divides by. On AMD CPUs with AVX-512 MKL runs its AVX2 code,
    so oneDNN's rate is ~2x MKL's and the bound is half what ``a @ b`` would make it."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    fns = {"aten": lambda: a @ b}
    try:
        from engine.model.onednn_linear import onednn_available, onednn_matmul

        if onednn_available():
            bt = b.t().contiguous()
            fns["onednn"] = lambda: onednn_matmul(a, bt, None)
    except ImportError:
        pass
    rates = {}
    for name, fn in fns.items():
        fn()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            reps += 1
        rates[name] = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    rates["best"] = max(rates.values())
    return rates


def loadavg() -> float:
    return os.getloadavg()[0]


# ---- the two sides, each a whole process -------------------------------------------------------
def run_rl(work: Path, model_dir: Path, shape: str, steps: int, extra: list[str], threads: int) -> dict:
    *_, P, G, N = SHAPES[shape]
    run_dir = Path(tempfile.mkdtemp(prefix="rl-vs-trl-", dir="/tmp"))
    shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "rlcli.main", "train", f"model.path={model_dir}", "task=jsonl",
           f"task.path={work / 'prompts.jsonl'}", "task.reward_fn=vstrl_reward:rl_reward", "task.num_val=0",
           f"data.train_batch_size={P}", f"algorithm.rollout_n={G}", f"rollout.max_new_tokens={N}",
           "rollout.ignore_eos=true", "rollout.temperature=1.0", "rollout.top_p=1.0",
           f"optim.lr={LR}", "optim.warmup_steps=0", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
           "algorithm.kl_coef=0", "algorithm.entropy_coef=0", f"trainer.total_steps={steps}",
           "trainer.device=cpu", f"trainer.threads_per_rank={threads}",
           "checkpoint.save_freq=0", "checkpoint.save_final=false", f"checkpoint.dir={run_dir}", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"rl train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"wall": wall, "step_s": [r["step_time_s"] for r in rows],
            "gen_tokens": [r["response_len_mean"] * P * G for r in rows],
            "reward": [r["reward_mean"] for r in rows],
            "rollout_s": [r["timing"].get("rollout", 0.0) for r in rows],
            "update_s": [r["timing"].get("update", 0.0) for r in rows]}


def run_trl(work: Path, model_dir: Path, shape: str, steps: int, threads: int, omp_default: bool,
            heap_tuned: bool = False) -> dict:
    out = Path(tempfile.mkdtemp(prefix="trl-", dir="/tmp")) / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(model_dir), "--shapes", shape,
           "--steps", str(steps), "--result", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    if not omp_default:  # the OpenMP waits rl's ranks get (engine/threads.py, trainer.omp_wait=auto)
        from engine.threads import omp_spin_count, rank_env

        env.update({k: v for k, v in rank_env(threads, omp_spin_count("auto", threads)).items()
                    if k in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")})
    if heap_tuned:  # the thresholds rl's ranks set with mallopt (engine/host_heap.py)
        from engine.host_heap import MMAP_THRESHOLD, TRIM_THRESHOLD

        env["GLIBC_TUNABLES"] = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"TRL failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    res["wall"] = wall
    return res


def trl_worker(model_dir: str, shape: str, steps: int, result: str) -> None:
    """Inside the TRL process: GRPOTrainer on the same job; per-step wall times via a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trl_steps import step_recorder

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    sys.path.insert(0, os.getcwd())
    from vstrl_reward import trl_reward

    *_, P, G, N = SHAPES[shape]
    prompts = [json.loads(x)["prompt"] for x in Path("prompts.jsonl").read_text().splitlines() if x.strip()]
    ds = Dataset.from_list([{"prompt": p} for p in prompts])
    times, logs = [], []

    out_dir = tempfile.mkdtemp(prefix="trl-out-", dir="/tmp")  # TRL wants one; nothing is saved there
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1, num_generations=G, max_completion_length=N, max_steps=steps,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.99, max_grad_norm=1.0, optim="adamw_torch", beta=0.0, num_iterations=1, temperature=1.0,
        top_p=1.0, generation_kwargs={"min_new_tokens": N}, gradient_checkpointing=False, bf16=False, fp16=False,
        use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
        seed=0, disable_tqdm=True, log_completions=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=trl_reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[step_recorder(times, logs)])
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    gen = [lg["completions/mean_length"] * P * G for lg in logs]
    Path(result).write_text(json.dumps({"step_s": times, "gen_tokens": gen,
                                        "reward": [lg.get("reward", 0.0) for lg in logs]}))


# ---- driver ------------------------------------------------------------------------------------
def summarise(runs: list[dict], warmup: int) -> dict:
    per_proc = [statistics.median(r["step_s"][warmup:]) for r in runs]
    gen = [statistics.median(r["gen_tokens"][warmup:]) for r in runs]
    parts = {k: statistics.median(statistics.median(r[k][warmup:]) for r in runs)
             for k in ("rollout_s", "update_s") if k in runs[0]}
    # what each tool learnt in the same steps (a faster step that learns less is not faster): the
    # mean reward of each process's last half of steps, and its mean completion length
    half = lambda xs: xs[len(xs) // 2:] or xs  # noqa: E731
    reward_last = [statistics.mean(half(r["reward"])) for r in runs]
    completion_len = [statistics.mean(r["gen_tokens"]) / r["rows"] for r in runs]
    return {**parts, "reward_last_half": statistics.median(reward_last), "reward_first": statistics.median(
                r["reward"][0] for r in runs), "completion_len": statistics.median(completion_len),
            "step_s": statistics.median(per_proc), "step_s_runs": per_proc, "gen_tokens": statistics.median(gen),
            "wall": statistics.median(r["wall"] for r in runs), "loads": [r["load"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped from each process's median")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default="/tmp/rl-vs-trl")
    ap.add_argument("--rl-extra", nargs="*", default=[], help="extra `rl train` overrides")
    ap.add_argument("--trl-omp-default", action="store_true",
                    help="run TRL with the OpenMP wait policy of the environment (default: the waits rl's ranks get)")
    ap.add_argument("--trl-heap-tuned", action="store_true",
                    help="run TRL with the glibc malloc thresholds rl's ranks use (trainer.keep_host_heap)")
    ap.add_argument("--json", default="")
    ap.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker, args.shapes[0], args.steps, args.result)

    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    work = Path(args.work)
    out = []
    for shape in args.shapes:
        *_, P, G, N = SHAPES[shape]
        model_dir = build_job(work, shape)
        facts = model_facts(model_dir)
        trl_runs, rl_runs = [], []
        peaks = [matmul_peak_flops(threads)]
        for rep in range(args.repeats):
            order = ("trl", "rl") if rep % 2 == 0 else ("rl", "trl")
            for side in order:
                load = loadavg()
                if side == "trl":
                    r = run_trl(work, model_dir, shape, args.steps, threads, args.trl_omp_default, args.trl_heap_tuned)
                    trl_runs.append(r | {"load": load, "rows": P * G})
                else:
                    r = run_rl(work, model_dir, shape, args.steps, args.rl_extra, threads)
                    rl_runs.append(r | {"load": load, "rows": P * G})
                print(f"  {shape} rep {rep} {side:3s}: median step {statistics.median(r['step_s'][args.warmup:]):.3f} s "
                      f"(process {r['wall']:.1f} s, load {load:.1f})", flush=True)
            peaks.append(matmul_peak_flops(threads))
        peak = statistics.median(p["best"] for p in peaks)
        peak_by_lib = {k: statistics.median(p.get(k, 0.0) for p in peaks) for k in peaks[0]}
        t, r = summarise(trl_runs, args.warmup), summarise(rl_runs, args.warmup)
        fl = step_flops(facts, P * G, N)
        bound = fl["total"] / peak
        upd_tokens = P * G * (facts["prompt_len_mean"] + N)
        row = {"shape": shape, "params": facts["params"], "prompts": P, "samples": G, "new_tokens": N,
               "threads": threads, "matmul_peak_flops": peak, "matmul_peak_by_library": peak_by_lib, "step_flops": fl["total"], "flop_bound_s": bound,
               "trl": t, "rl": r, "speedup": t["step_s"] / r["step_s"], "rl_vs_bound": r["step_s"] / bound,
               "trl_vs_bound": t["step_s"] / bound,
               "gen_tok_s": {"trl": t["gen_tokens"] / t["step_s"], "rl": r["gen_tokens"] / r["step_s"]},
               "update_tok_s": {"trl": upd_tokens / t["step_s"], "rl": upd_tokens / r["step_s"]}}
        out.append(row)
    print(f"\nrl vs TRL {_trl_version()} GRPOTrainer, {threads} thread(s), fp32, {args.repeats} repeats x "
          f"{args.steps} steps (first {args.warmup} dropped), medians; TRL's OpenMP waits "
          f"{'from the environment' if args.trl_omp_default else 'as rl ranks get them'}, its malloc "
          f"{'tuned as rl ranks (GLIBC_TUNABLES)' if args.trl_heap_tuned else 'glibc defaults'}")
    hdr = (f"{'shape':7s} {'params':>7s} {'PxGxN':>9s} {'TRL s/step':>10s} {'rl s/step':>9s} {'rl/TRL speed':>12s} "
           f"{'gen tok/s TRL|rl':>17s} {'upd tok/s TRL|rl':>17s} {'bound s':>8s} {'rl/bound':>8s} {'TRL/bound':>9s} "
           f"{'loads':>14s}")
    print(hdr)
    for x in out:
        loads = x["trl"]["loads"] + x["rl"]["loads"]
        print(f"{x['shape']:7s} {x['params'] / 1e6:6.1f}M {x['prompts']}x{x['samples']}x{x['new_tokens']:<4d} "
              f"{x['trl']['step_s']:10.3f} {x['rl']['step_s']:9.3f} {x['speedup']:11.2f}x "
              f"{x['gen_tok_s']['trl']:8.0f}|{x['gen_tok_s']['rl']:<8.0f} "
              f"{x['update_tok_s']['trl']:8.0f}|{x['update_tok_s']['rl']:<8.0f} {x['flop_bound_s']:8.3f} "
              f"{x['rl_vs_bound']:7.2f}x {x['trl_vs_bound']:8.2f}x {min(loads):5.1f}-{max(loads):<5.1f}")
        rates = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in x["matmul_peak_by_library"].items() if k != "best")
        print(f"        fp32 matmul peak (GFLOP/s, 1024^3): {rates}; the bound uses the best")
        print(f"        learnt: reward first step -> mean of the last half, TRL {x['trl']['reward_first']:.3f} -> "
              f"{x['trl']['reward_last_half']:.3f}, rl {x['rl']['reward_first']:.3f} -> {x['rl']['reward_last_half']:.3f}; "
              f"completion length TRL {x['trl']['completion_len']:.1f}, rl {x['rl']['completion_len']:.1f} tokens")
        print(f"        rl: rollout {x['rl'].get('rollout_s', 0):.3f} s + update {x['rl'].get('update_s', 0):.3f} s "
              f"per step; process wall TRL {x['trl']['wall']:.1f} s, rl {x['rl']['wall']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": threads, "args": vars(args), "rows": out}, indent=1))


def _trl_version() -> str:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
