"""bench/gpu_bench.py (issue 41) runs end to end on the tiny shape on CPU and its JSON holds every
figure the device run reports, with MFU recomputable from the JSON's own inputs: so the prepared
device script is known to work before a GPU is lent."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rl_rollout", "rl_update", "hf_generate", "hf_train")


def test_gpu_bench_tiny_cpu_json(tmp_path):
    out = tmp_path / "gpu_bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "bench/gpu_bench.py", "--shape", "tiny", "--device", "cpu", "--steps", "1",
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "elapsed" in p.stdout and "rl / HF" in p.stdout
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["dtype"] == "float32"
    assert r["matmul_peak_flops"] > 1e8 and r["copy_bandwidth_bytes_per_s"] > 1e8 and r["elapsed_s"] > 0
    (s,) = r["shapes"]
    m = s["model"]
    # matmul params from first principles: the tiny Llama's linear layers plus its untied LM head
    hd = m["hidden_size"] // m["num_attention_heads"]
    per_layer = (m["hidden_size"] * m["hidden_size"] * 2  # q, o
                 + 2 * m["hidden_size"] * m["num_key_value_heads"] * hd  # k, v
                 + 3 * m["hidden_size"] * m["intermediate_size"]  # gate, up, down
                 + 2 * m["hidden_size"])  # the two RMSNorms
    expected = m["num_layers"] * per_layer + m["hidden_size"] + m["hidden_size"] * s["vocab"]
    assert s["matmul_params"] == expected
    assert s["params"] == expected + m["hidden_size"] * s["vocab"]  # + the input embedding
    b = s["batch"]
    rows = b["prompts"] * b["samples"]
    for name in PHASES:
        ph = s["phases"][name]
        assert ph["seconds"] > 0 and ph["tokens"] > 0 and ph["peak_memory_bytes"] > 0 and ph["steps"] == 1
        assert math.isclose(ph["tokens_per_s"], ph["tokens"] / ph["seconds"], rel_tol=1e-9)
        factor = 2 if name in ("rl_rollout", "hf_generate") else 6
        assert ph["flops_per_token"] == factor * s["matmul_params"]
        mfu = factor * s["matmul_params"] * ph["tokens"] / ph["seconds"] / r["matmul_peak_flops"]
        assert math.isclose(ph["mfu"], mfu, rel_tol=1e-9) and 0 < ph["mfu"] < 1
    # every row generates exactly new_tokens (ignore_eos), in rl and in the HF loop alike
    assert s["phases"]["rl_rollout"]["tokens"] == s["phases"]["hf_generate"]["tokens"] == rows * b["new_tokens"]
    assert s["phases"]["hf_train"]["tokens"] == rows * (b["prompt_len"] + b["new_tokens"])
    assert set(s["update_rows"]) == {"1", "2", "4", "8"}
    for k, v in s["update_rows"].items():
        assert v["seconds"] > 0 and v["tokens"] > 0
    d = s["decode_bound"]
    assert d["rows"] == rows and d["bound_tokens_per_s"] > 0
    assert math.isclose(d["bound_tokens_per_s"], rows * d["bandwidth_bytes_per_s"]
                        / (d["weight_bytes"] + d["mean_kv_cache_bytes"]), rel_tol=1e-9)
    assert d["weight_bytes"] == 4 * s["matmul_params"]  # fp32
    ratios = s["ratios_rl_over_hf"]
    assert math.isclose(ratios["train_tokens_per_s"], s["phases"]["rl_update"]["tokens_per_s"]
                        / s["phases"]["hf_train"]["tokens_per_s"], rel_tol=1e-9)
    assert len(s["step_split_s"]) == 1
    # the cuda_graphs rollout (eager here) samples the plain rollout's tokens from the same noise
    assert s["cuda_graphs_same_tokens"] == [1.0, 1.0]  # the warm-up step and the measured one: every token
    assert s["phases"]["rl_rollout_cuda_graphs"]["tokens"] == s["phases"]["rl_rollout"]["tokens"]


def test_gpu_bench_cuda_without_device_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        return
    p = subprocess.run([sys.executable, "bench/gpu_bench.py", "--device", "cuda"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "no CUDA device" in p.stderr and "Traceback" not in p.stderr
