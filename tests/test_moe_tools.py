"""`rl inspect-ckpt` and `rl mem-report` on mixture-of-experts models: experts per layer, expert
and router parameters, routing-record bytes; dense models show none of it."""

from __future__ import annotations

import json

import pytest

from tests.cli_utils import cli
from tests.tiny_hf import save_tiny_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tools")
    return {"mixtral": save_tiny_model("mixtral", root / "mixtral", experts=8),
            "qwen2_moe": save_tiny_model("qwen2_moe", root / "qwen2_moe", experts=6, layers=3),
            "llama": save_tiny_model("llama", root / "llama")}


def _expert_params(path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path)
    return sum(p.numel() for n, p in m.named_parameters() if ".experts." in n and "shared_expert" not in n)


def test_inspect_ckpt_shows_experts_per_layer(dirs):
    r = cli("inspect-ckpt", str(dirs["mixtral"]), "--json")
    assert r.exit_code == 0, r.stdout
    moe = json.loads(r.stdout)["info"]["experts"]
    assert moe == {"moe_layers": 2, "experts_per_layer": 8, "expert_params": _expert_params(dirs["mixtral"]),
                   "router_params": 2 * 8 * 32, "dense_layers": 0}
    q = json.loads(cli("inspect-ckpt", str(dirs["qwen2_moe"]), "--json").stdout)["info"]["experts"]
    assert q["moe_layers"] == 3 and q["experts_per_layer"] == 6
    assert q["expert_params"] == _expert_params(dirs["qwen2_moe"])  # the shared expert is not one of them
    dense = json.loads(cli("inspect-ckpt", str(dirs["llama"]), "--json").stdout)
    assert "experts" not in dense["info"]
    text = cli("inspect-ckpt", str(dirs["mixtral"])).stdout
    assert "experts_per_layer=8" in text


def test_expert_layouts_by_name_per_expert_and_megatron_grouped():
    """Hub-style per-expert modules, Megatron grouped GEMM weights, mixed counts per layer."""
    from engine.inspect.experts import expert_summary
    from engine.inspect.report import TensorInfo

    ts = [TensorInfo(f"model.layers.0.block_sparse_moe.experts.{e}.w{i}.weight", "bf16", (4, 2), group="model")
          for e in range(8) for i in (1, 2, 3)]
    ts.append(TensorInfo("model.layers.0.block_sparse_moe.gate.weight", "bf16", (8, 2), group="model"))
    ts += [TensorInfo(f"decoder.layers.1.mlp.experts.linear_fc1.weight{e}", "bf16", (4, 2), group="model")
           for e in range(16)]
    ts.append(TensorInfo("decoder.layers.1.mlp.router.weight", "bf16", (16, 2), group="model"))
    ts.append(TensorInfo("model.layers.2.mlp.down_proj.weight", "bf16", (2, 4), group="model"))
    ts.append(TensorInfo("optim.state.model.layers.0.block_sparse_moe.experts.9.w1.weight.exp_avg", "fp32", (4, 2),
                         group="optimizer state"))
    s = expert_summary(ts)
    assert s["experts_per_layer"] == {"0": 8, "1": 16} and s["moe_layers"] == 2 and s["dense_layers"] == 1
    assert s["expert_params"] == 8 * 3 * 8 + 16 * 8 and s["router_params"] == 16 + 32


def test_mem_report_counts_expert_params_and_routing_records(dirs):
    r = cli("mem-report", "--estimate", f"model.path={dirs['mixtral']}", "algorithm.router_replay=replay",
            "engine.micro_batch_size=4", "--json")
    assert r.exit_code == 0, r.stdout
    est = json.loads(r.stdout)["estimate"]
    moe = est["moe"]
    assert moe["expert_params"] == _expert_params(dirs["mixtral"]) and moe["router_params"] == 2 * 8 * 32
    assert (moe["moe_layers"], moe["experts_per_layer"], moe["top_k"]) == (2, 8, 2)
    seq = est["assumptions"]["seq_len"]
    assert moe["routing_bytes_micro_batch"] == 4 * seq * 2 * 2 * 2  # tokens x layers x k x int16
    text = cli("mem-report", "--estimate", f"model.path={dirs['mixtral']}").stdout
    assert "expert params" in text and "routing records" in text
    dense = json.loads(cli("mem-report", "--estimate", f"model.path={dirs['llama']}", "--json").stdout)
    assert dense["estimate"]["moe"] is None
