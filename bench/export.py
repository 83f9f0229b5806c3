"""Benchmark: `rl export` against the usual hand-rolled conversion, on the same checkpoint of
the SmolLM2-135M preset (134.5M parameters, fp32 masters + AdamW state), in the same run.

    rl export:  rl export <run> --out A                      (reads only model.* entries)
    baseline:   torch.distributed.checkpoint.format_utils.dcp_to_torch_save(state/, x.pt)
                + torch.load + AutoModelForCausalLM(...).load_state_dict + save_pretrained(B)

Each side runs in its own fresh Python process (imports included, as a user would run it), the
two interleaved over --reps repetitions; each reports wall time and its own peak RSS
(ru_maxrss). Prints the medians, the ratios rl/baseline, the checkpoint's size (model entries
vs all), and checks both outputs hold identical tensors.

    OMP_NUM_THREADS=1 python bench/export.py [--reps 3] [--run DIR]

Without --run, it first trains one tiny step of `model=smollm2-135m` (needs `rl[smollm2]`,
docs/smollm2.md) into a temporary run directory to get a real rl checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RL_EXPORT = """
import json, resource, sys, time
t0 = time.perf_counter()
from engine.export import export_checkpoint
r = export_checkpoint(sys.argv[1], out=sys.argv[2], dtype="float32")
print("RESULT" + json.dumps({"seconds": time.perf_counter() - t0,
                             "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                             "params": r.num_params}))
"""

BASELINE = """
import json, resource, sys, time
t0 = time.perf_counter()
from pathlib import Path
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
run, out, base = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
step = max((p for p in run.iterdir() if p.name.startswith("step_")), key=lambda p: int(p.name[5:]))
tmp = out.parent / (out.name + ".pt")
dcp_to_torch_save(str(step / "state"), str(tmp))
full = torch.load(tmp, weights_only=False)
model_sd = full["model"]
del full
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=torch.float32)
model.load_state_dict(model_sd, strict=False)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(base).save_pretrained(out)
tmp.unlink()
print("RESULT" + json.dumps({"seconds": time.perf_counter() - t0,
                             "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.split("RESULT", 1)[1].splitlines()[0])


def make_run(root: Path) -> Path:
    run = root / "run"
    cmd = [sys.executable, "-m", "rlcli.main", "train", "model=smollm2-135m", "task=echo", "trainer.total_steps=1",
           "data.train_batch_size=2", "algorithm.rollout_n=2", "rollout.max_new_tokens=4", "task.num_val=0",
           f"checkpoint.dir={run}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"could not make the SmolLM2 checkpoint:\n{r.stderr[-3000:]}")
    return run


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    def load(d: Path) -> dict:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    x, y = load(a), load(b)
    return set(x) == set(y) and all(bool((x[k] == y[k]).all()) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--run", type=Path, help="an existing rl run directory of the smollm2-135m preset")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from engine.checkpoint.layout import latest_complete
    from engine.export.weights import checkpoint_model_entries

    with tempfile.TemporaryDirectory(prefix="rl-bench-export-") as d:
        root = Path(d)
        run = args.run or make_run(root)
        step = latest_complete(run)
        manifest = json.loads((step.path / "manifest.json").read_text())
        base = manifest["model"].get("resolved_path")
        state = step.path / "state"
        total = sum(p.stat().st_size for p in state.iterdir())
        import math

        model_bytes = sum(math.prod(m.size) * 4 for m in checkpoint_model_entries(state).values())
        rl_rows, base_rows = [], []
        for i in range(args.reps):
            for name, rows, code, extra in (("rl", rl_rows, RL_EXPORT, ()), ("base", base_rows, BASELINE, (base,))):
                out = root / f"{name}{i}"
                rows.append(_run(code, str(run), str(out), *extra))
                if i == 0 and name == "base":
                    identical = same_tensors(root / "rl0", out)
        med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
        rl_t, b_t, rl_m, b_m = med(rl_rows, "seconds"), med(base_rows, "seconds"), med(rl_rows, "rss"), \
            med(base_rows, "rss")
        gib = 1 << 30
        print(f"checkpoint: {step.path} ({rl_rows[0]['params']:,} params; DCP state {total / gib:.2f} GiB, of "
              f"which model entries {model_bytes / gib:.2f} GiB)")
        print(f"reps: {args.reps} (each side a fresh process, interleaved)")
        print(f"rl export            : {rl_t:7.1f} s   peak RSS {rl_m / gib:5.2f} GiB")
        print(f"dcp_to_torch_save+HF : {b_t:7.1f} s   peak RSS {b_m / gib:5.2f} GiB")
        print(f"ratio rl/baseline    : time {rl_t / b_t:.2f}x, peak RSS {rl_m / b_m:.2f}x")
        print(f"identical tensors    : {identical}")


if __name__ == "__main__":
    main()
