"""LoRA with peft on the FSDP2 engine: only adapters train and are checkpointed (with the base
model's path and sha256), resume is exact, a LoRA run learns the default task, and `rl export`
merges the adapters (or writes a PEFT adapter directory) to what the policy generated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_utils import rl as run_rl
from tests.dist_utils import run_ranks

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
VOCAB, PAD, EOS = 12, 0, 1
LORA = ["model.lora.rank=8", "model.lora.alpha=16", "optim.lr=2e-2"]   # peft's Llama default: q_proj, v_proj
# The learning run adapts every linear layer of the tiny model, lm_head included. The tiny model
# is a random init, not a pretrained one: with lm_head frozen (its weights ~0.02) behind the
# frozen final RMSNorm, logits stay within a few tenths of each other and the policy cannot leave
# near-uniform (measured: entropy 2.47 -> 2.37 of ln 12 = 2.48, reward flat at ~0.09 over 9 steps).
# lr scan on this job (16 prompts x 8, 40 steps): 5e-3 reached 1.9x (first-10 0.11 -> last-10 0.21),
# 1e-2 reached 2.9x (0.13 -> 0.37), 2e-2 and 3e-2 collapsed the policy (entropy -> 0.03).
# lr 3e-3: at 1e-2 the policy's entropy reached ~0 by step 30 and whether the last 10 steps doubled
# the first 10 came down to the sampling noise (0.16 -> 0.34 and 0.16 -> 0.23 with two noise
# streams); at 3e-3 it learns steadily (0.13 -> 0.74, entropy 2.5 -> 0.9), measured 2026-12-01
LORA_RUN = ["model.lora.rank=16", "model.lora.alpha=32", "optim.lr=3e-3",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"]


def _engine(overrides):
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config

    cfg = load_run_config(overrides).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    return cfg, eng


def _batch(seed: int):
    from engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    B, T = 8, 10
    ids = torch.randint(2, VOCAB, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    resp = attn.float().clone()
    resp[:, :3] = 0
    adv = torch.randn(B, generator=g)[:, None] * resp
    return SequenceBatch(input_ids=ids, attention_mask=attn, response_mask=resp,
                         prompt_lengths=torch.full((B,), 3), advantages=adv)


def _adapters_only(rank, world, ckpt_dir):
    import torch.distributed.checkpoint as dcp

    from engine.algorithms.policy_loss import PolicyLoss
    from engine.model.lora import base_name

    cfg, eng = _engine([*LORA, "optim.warmup_steps=0"])
    out = {}
    named = dict(eng.model.named_parameters())
    in_opt = {id(p) for g in eng.optimizer.param_groups for p in g["params"]}
    out["opt_names"] = sorted(n for n, p in named.items() if id(p) in in_opt)
    out["lora_names"] = sorted(n for n in named if "lora_" in n)
    before = eng.export_hf_state_dict()
    eng.train_step(_batch(0), PolicyLoss(cfg.algorithm, world))
    state = eng.checkpoint_state()
    out["ckpt_model_keys"] = sorted(state["model"])
    out["reference"] = eng.lora_reference
    dcp.save(state, checkpoint_id=ckpt_dir)
    sched = eng.lr_scheduler.state_dict()
    merged = eng.export_hf_state_dict()
    out["merged_names_equal"] = sorted(merged) == sorted(before)
    out["merged_changed"] = sorted(k for k in merged if not torch.equal(merged[k], before[k]))
    from torch.distributed.tensor import DTensor

    raw = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in eng.model.state_dict().items()}
    out["base_unchanged"] = all(torch.equal(before[base_name(k)], v) for k, v in raw.items() if ".base_layer." in k)
    eng.train_step(_batch(1), PolicyLoss(cfg.algorithm, world))
    out["continued"] = eng.export_hf_state_dict()
    # a fresh engine resumed from the checkpoint takes the identical second step
    cfg2, eng2 = _engine([*LORA, "optim.warmup_steps=0"])
    state2 = eng2.checkpoint_state()
    dcp.load(state2, checkpoint_id=ckpt_dir)
    eng2.load_checkpoint_state(state2)
    eng2.lr_scheduler.load_state_dict(sched)
    eng2.train_step(_batch(1), PolicyLoss(cfg2.algorithm, world))
    out["resumed"] = eng2.export_hf_state_dict()
    return out


def test_lora_trains_and_checkpoints_only_adapters_and_resumes_exactly(tmp_path):
    """On 2 FSDP2 ranks: the optimizer holds exactly the LoRA A/B matrices, the checkpoint's
    model entries are only those (the manifest gets the base model's sha256 instead), the base
    weights never change, the merged weights handed to vLLM/export keep the base model's names
    and change only on adapted layers, and a fresh engine loaded from the checkpoint takes a
    bit-identical next step."""
    r0, r1 = run_ranks(_adapters_only, 2, str(tmp_path / "ck"))
    assert r0["opt_names"] == r0["lora_names"] and r0["lora_names"]
    assert all(("q_proj.lora_" in n or "v_proj.lora_" in n) for n in r0["lora_names"])  # peft's Llama default
    assert r0["ckpt_model_keys"] == r0["lora_names"]
    ref = r0["reference"]
    assert ref["rank"] == 8 and len(ref["base_sha256"]) == 64 and ref["base_path"] == ""
    assert r0["merged_names_equal"] and r0["base_unchanged"]
    assert r0["merged_changed"] and all(("q_proj" in k or "v_proj" in k) for k in r0["merged_changed"])
    for k, v in r0["continued"].items():
        assert torch.equal(v, r0["resumed"][k]), k
    assert r0["reference"] == r1["reference"]


def rl(*args, timeout=3000):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a 40-step training run, then three exports
def test_lora_run_learns_and_exports_merged_and_adapter(tmp_path):
    """`rl train model.lora.rank=16` (all linear layers) learns the default echo task (reward of the last 10 steps at
    least twice the first 10); the merged export generates, through transformers alone, rl's own
    greedy validation responses on the 32 held-out prompts; --adapter writes a PEFT directory
    whose PeftModel over the base gives the merged export's logits; a changed base is refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.config.load import load_run_config
    from engine.errors import CheckpointError
    from engine.export import export_checkpoint
    from engine.model.build import build_hf_model
    from tests.test_export import final_validation, held_out_prompts, hf_greedy

    run = tmp_path / "run"
    # a fixed thread count: with the automatic one, ranks follow the free cores, and the run's
    # numerics (so this learning curve) would depend on the machine's load
    r = rl("train", *LORA_RUN, "trainer.total_steps=40", "data.train_batch_size=16", "task.num_val=32",
           "trainer.val_freq=40", "trainer.threads_per_rank=2", f"checkpoint.dir={run}", "--json")
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(r.stdout)
    assert s["reward_last10"] >= 2 * s["reward_first10"], s
    manifest = json.loads((run / "step_40" / "manifest.json").read_text())
    assert manifest["model"]["lora"]["rank"] == 16 and len(manifest["model"]["lora"]["base_sha256"]) == 64

    merged = export_checkpoint(run, out=tmp_path / "merged")
    assert merged.kind == "merged-lora"
    assert hf_greedy(tmp_path / "merged", held_out_prompts()) == final_validation(run)["responses"]

    adapter = export_checkpoint(run, out=tmp_path / "adapter", adapter=True)
    assert adapter.kind == "lora-adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in adapter.files}
    from engine.inspect import inspect_path

    rep = inspect_path(tmp_path / "adapter")  # rl inspect-ckpt recognises a PEFT adapter directory
    assert rep.format == "peft-adapter" and rep.info["adapter_config"]["r"] == 16
    cfg = load_run_config([*LORA_RUN]).config
    base = build_hf_model(cfg.model, "", VOCAB, cfg.trainer.seed, PAD, EOS)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        unmerged, merged = peft(input_ids=ids).logits, plain(input_ids=ids).logits
    # W x + s B (A x) and (W + s B A) x round differently in fp32, by an amount that depends on the
    # CPU's kernels: up to 1.8e-4 at |logit| ~16 measured (1e-5 relative); a wrong merge (scale,
    # transpose, a missed module) is off by orders of magnitude more
    torch.testing.assert_close(unmerged, merged, rtol=1e-4, atol=1e-4)

    from tests.ckpt_tools import reseal

    # a manifest naming another base model, resealed (export verifies the manifest's digest first)
    reseal(run / "step_40", lambda m: m["model"]["lora"].update(base_sha256="0" * 64))
    with pytest.raises(CheckpointError, match="base model .* has changed"):
        export_checkpoint(run, out=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_rl_resume_of_a_lora_run_is_bit_exact(tmp_path):
    """End to end through the CLI, on 2 ranks: a LoRA run of 4 steps straight, and the same run
    stopped after step 2 and continued with `rl resume`, end with identical adapter and optimizer
    state (every DCP entry) and identical metric rows."""
    from tests.test_resume import assert_same_state, dcp_tensors, metrics, stopped_after

    common = [*LORA_RUN, "trainer.nprocs=2", "trainer.total_steps=4", "checkpoint.save_freq=2",
              "data.train_batch_size=4", "algorithm.rollout_n=2", "checkpoint.keep_last=0"]
    straight = tmp_path / "straight"
    r = rl("train", *common, f"checkpoint.dir={straight}")
    assert r.returncode == 0, r.stderr[-3000:]
    run = stopped_after(straight, tmp_path / "resumed", 2)
    r = rl("resume", str(run), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["first_step"] == 3
    want = dcp_tensors(straight / "step_4" / "state")
    assert any(".lora_A." in k for k in want) and not any(k.startswith("model.") and ".base_layer." in k
                                                           for k in want)  # adapters only
    assert_same_state(want, dcp_tensors(run / "step_4" / "state"))
    got, ref = metrics(run), metrics(straight)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for key in ("reward_mean", "pg_loss", "entropy", "grad_norm", "lr"):
        assert [m[key] for m in got] == [m[key] for m in ref], key


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_merged_weights_equal_peft_merge_and_unload(arch, tmp_path):
    """The merged weights the engine syncs to vLLM (computed from gathered tensors) equal peft's
    own merge_and_unload, including GPT-2's transposed Conv1D layers (fan_in_fan_out)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.config.schema import LoraConfig as RlLora
    from engine.model.lora import base_name, inject, merged_weights
    from tests.tiny_hf import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(arch, tmp_path / arch))
    lora = RlLora(rank=4, alpha=8.0)
    injected, _ = inject(copy.deepcopy(model), lora, "")
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in injected.named_parameters():
            if "lora_B" in n:
                p.normal_()
    full = dict(injected.state_dict())
    ours = {base_name(k): v for k, v in full.items() if "lora_" not in k}
    ours.update(merged_weights(injected, full))
    targets = ["q_proj", "v_proj"] if arch == "llama" else ["c_attn"]
    ref = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8.0, target_modules=targets,
                                                          fan_in_fan_out=arch == "gpt2"))
    ref.load_state_dict({"base_model.model." + k: v for k, v in full.items()}, strict=False)
    theirs = ref.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    changed = 0
    for k in ours:
        assert torch.allclose(ours[k], theirs[k], atol=1e-6), k
        changed += not torch.equal(ours[k], model.state_dict()[k])
    assert changed == 2 * (2 if arch == "llama" else 1)


def _vllm_lora_rank(rank, world):
    """FSDP engine with LoRA + vLLM sampler: vLLM gets the merged weights after an update."""
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.rollout.vllm_sampler import VLLMSampler

    cfg = load_run_config(["rollout=vllm", "trainer.device=cpu", "model.hidden_size=128", "model.num_attention_heads=4",
                           *LORA, "rollout.max_new_tokens=9", "data.train_batch_size=4", "algorithm.rollout_n=4",
                           "optim.lr=0.05", "optim.warmup_steps=0"]).config
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    sampler = VLLMSampler.from_engine(cfg, eng, "", {"size": VOCAB, "pad": PAD, "eos": EOS}, eng.device, rank)
    out = {}
    try:
        prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [2]]
        batch = sampler.generate(None, prompts, 4, torch.Generator().manual_seed(0))
        batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(3))[:, None] \
            * batch.response_mask
        eng.train_step(batch, PolicyLoss(cfg.algorithm, world))
        out["stale"] = sampler.verify_sync(eng, batch, raise_on_mismatch=False)
        out["sync_s"] = sampler.sync_weights(eng.export_hf_state_dict())
        out["last_sync"] = sampler.last_sync
        out["synced"] = sampler.verify_sync(eng, batch)
        out["adapter_params"] = sum(p.numel() for n, p in eng.model.named_parameters() if "lora_" in n)
        out["model_params"] = sum(v.numel() for v in eng.export_hf_state_dict().values())
    finally:
        sampler.shutdown()
    return out


@pytest.mark.vllm
def test_lora_vllm_receives_merged_weights():
    """rollout=vllm with LoRA: after an update vLLM's log-probs are stale; after syncing the
    merged weights they equal the trainer's (adapter-carrying) recompute. Prints the measured
    sync: bytes (the whole model) and seconds, against the adapter's size."""
    from engine.rollout.vllm_sampler import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(f"vllm cannot be imported here ({reason})")
    (r,) = run_ranks(_vllm_lora_rank, 1)
    assert not r["stale"].ok
    assert r["synced"].ok and r["synced"].max_abs < 1e-3, r["synced"]
    print(f"LoRA vLLM sync (merged weights): {r['last_sync']['bytes']} B in {r['sync_s'] * 1000:.1f} ms "
          f"(write {r['last_sync']['write_s'] * 1000:.1f} ms, reload {r['last_sync']['reload_s'] * 1000:.1f} ms); "
          f"model {r['model_params']:,} params, adapters {r['adapter_params']:,}; "
          f"max |dlogp| after sync {r['synced'].max_abs:.2e}")


def test_mem_report_estimates_lora_grads_and_optimizer_for_adapters_only():
    """`rl mem-report --estimate` with model.lora.rank counts gradients and AdamW state for the
    adapter parameters alone: r * (in + out) per adapted Linear, per layer."""
    from engine.config.load import load_run_config
    from engine.memory.estimate import BUILTIN_MODELS, estimate_memory

    dims = BUILTIN_MODELS["llama3-8b"]
    full = estimate_memory(load_run_config(["trainer.nprocs=8"]).config, model="llama3-8b")
    lora = estimate_memory(load_run_config(["trainer.nprocs=8", "model.lora.rank=16",
                                            "model.lora.target_modules=[q_proj,v_proj]"]).config, model="llama3-8b")
    per_layer = 16 * ((dims.hidden_size + dims.num_attention_heads * dims.d)
                      + (dims.hidden_size + dims.num_key_value_heads * dims.d))
    n = per_layer * dims.num_layers
    assert lora.per_rank["optimizer"] == -(-n // 8) * 8          # fp32 m and v
    assert lora.per_rank["optimizer"] < full.per_rank["optimizer"] / 100
    assert lora.per_rank["grads"] < full.per_rank["grads"] / 10
    assert "LoRA" in lora.formulas["optimizer"]
