"""Models in: `model.path` is any transformers causal LM, as a local directory or a hub id in
the local Hugging Face cache (offline), and FSDP2 shards its decoder blocks whatever they are
called. Bad paths are one clear error, exit 2, before any run directory exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.tiny_hf import ARCHS, char_tokenizer, fake_hub_cache, save_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {a: save_tiny_model(a, root / a) for a in ARCHS}


def test_decoder_blocks_found_by_class_for_every_architecture(model_dirs):
    """FSDP2's per-block sharding uses the model's own _no_split_modules, so GPT-2 (h.N:
    GPT2Block) and GPT-NeoX (gpt_neox.layers) get one shard per block, not one root shard."""
    from transformers import AutoModelForCausalLM

    from engine.backends.fsdp import decoder_blocks

    expected = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "gpt2": "GPT2Block",
                "gpt_neox": "GPTNeoXLayer", "mistral": "MistralDecoderLayer"}
    for arch, path in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        blocks = decoder_blocks(model)
        assert [type(b).__name__ for b in blocks] == [expected[arch]] * 2, arch


def _train_each(rank, world, dirs):
    from torch.distributed.fsdp import FSDPModule

    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine, decoder_blocks
    from engine.config.load import load_run_config
    from engine.rollout.torch_sampler import TorchSampler
    from engine.trainer.worker_group import shard_slices

    tok = char_tokenizer()
    out = {}
    for arch, path in dirs.items():
        cfg = load_run_config([f"model.path={path}", "rollout.max_new_tokens=6", "optim.lr=1e-2"]).config
        eng = FSDPEngine(cfg, str(path), tok.vocab_size, tok.pad_token_id, tok.eos_token_id,
                         torch.device("cpu"), updates_per_step=1)
        eng.build()
        sharded = [isinstance(b, FSDPModule) for b in decoder_blocks(eng.model)]
        before = {k: v.clone() for k, v in eng.export_hf_state_dict().items()}
        sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, eng.device)
        prompts = [tok.encode("ab:"), tok.encode("c:"), tok.encode("abc:"), tok.encode("d:")]
        with eng.generation_model() as m:
            batch = sampler.generate(m, prompts, 2, torch.Generator().manual_seed(0))
        batch.advantages = torch.randn(len(batch))[:, None] * batch.response_mask
        batch = batch.select(shard_slices(len(batch), world)[rank])
        stats = eng.train_step(batch, PolicyLoss(cfg.algorithm, world))
        after = eng.export_hf_state_dict()
        changed = sum(not torch.equal(before[k], after[k]) for k in before)
        out[arch] = {"sharded": sharded, "changed": changed, "n": len(before),
                     "finite": all(torch.isfinite(v).all() for v in after.values()),
                     "grad_norm": stats.replicated["grad_norm"]}
    return out


@pytest.mark.slow
def test_fsdp_trains_every_architecture_on_two_ranks(model_dirs):
    """Llama, Qwen2, GPT-2, GPT-NeoX and Mistral directories train on 2 FSDP2 ranks: every
    decoder block is its own FSDP unit, one step updates the weights, nothing goes non-finite,
    and both ranks end with the same full weights."""
    results = run_ranks(_train_each, 2, dict(model_dirs))
    for arch in ARCHS:
        r0, r1 = results[0][arch], results[1][arch]
        assert r0["sharded"] == [True, True], arch
        assert r0["finite"] and r0["grad_norm"] > 0, arch
        assert r0["changed"] > r0["n"] // 2, (arch, r0)
        assert r0["changed"] == r1["changed"]


def test_hub_id_resolves_from_local_cache(model_dirs, tmp_path, monkeypatch):
    """`model.path=org/name` finds the snapshot refs/main points at in HF_HUB_CACHE, offline."""
    from engine.config.schema import ModelConfig
    from engine.model.presets import resolve_model_path

    snap = fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-gpt2", model_dirs["gpt2"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Path(resolve_model_path(ModelConfig(path="tiny-org/tiny-gpt2"))).resolve() == snap.resolve()


def test_hub_id_not_cached_says_where_it_looked_and_how_to_fetch(tmp_path, monkeypatch):
    from engine.config.schema import ModelConfig
    from engine.errors import ConfigError
    from engine.model.presets import resolve_model_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as e:
        resolve_model_path(ModelConfig(path="Qwen/Qwen2.5-0.5B"))
    msg = e.value.message
    assert str(tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B") in msg
    assert "hf download Qwen/Qwen2.5-0.5B" in msg


def _rl(args, tmp_path, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "rlcli.main", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)


@pytest.mark.parametrize("case", ["missing", "no_config", "megatron_gpt2", "hub_missing"])
def test_bad_model_path_exits_2_before_a_run_dir_exists(case, model_dirs, tmp_path):
    """The README's own `rl train model.path=/models/Qwen2.5-0.5B` on a machine without it: one
    paragraph, exit 2, no traceback, and no run directory is created."""
    empty = tmp_path / "empty"
    empty.mkdir()
    args, needle = {
        "missing": (["train", "model.path=/models/Qwen2.5-0.5B"], "does not exist"),
        "no_config": (["train", f"model.path={empty}"], "without config.json"),
        "megatron_gpt2": (["train", "--engine", "megatron", f"model.path={model_dirs['gpt2']}"], "gpt2"),
        "hub_missing": (["train", "model.path=Qwen/Qwen2.5-0.5B"], "hf download"),
    }[case]
    r = _rl(args + ["checkpoint.dir=run"], tmp_path, {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and needle in " ".join(r.stderr.replace("│", " ").split()), r.stderr
    assert not (tmp_path / "run").exists()


def test_tiny_tokenizer_is_a_real_hf_tokenizer_with_the_same_ids(tmp_path):
    """The built-in model's character vocabulary, saved with save_pretrained and reloaded with
    AutoTokenizer, encodes every task's text to the same ids and decodes them back."""
    from transformers import AutoTokenizer

    from engine.config.schema import TaskConfig
    from engine.model.tokenizer import CharTokenizer
    from engine.tasks.registry import make_task

    for name in ("echo", "add"):  # the built-in tasks with a character alphabet
        task = make_task(TaskConfig(name=name), 0)
        assert task.alphabet
        tok = CharTokenizer(task.alphabet)
        tok.save_pretrained(tmp_path / name)
        hf = AutoTokenizer.from_pretrained(tmp_path / name)
        assert (hf.pad_token_id, hf.eos_token_id, len(hf)) == (0, 1, tok.vocab_size)
        for ex in task.train[:50] + task.val[:10]:
            text = ex.prompt + ex.answer
            ids = hf.encode(text, add_special_tokens=False)
            assert ids == tok.encode(text), (name, text)
            assert hf.decode(ids + [tok.eos_token_id, 0], skip_special_tokens=True) == tok.decode(ids) == text
        assert hf.encode("\u00e9", add_special_tokens=False) == [tok.unk_token_id]


@pytest.mark.slow
def test_hub_id_gpt2_trains_and_round_trips_through_export(model_dirs, tmp_path):
    """`rl train model.path=org/name` from a local HF cache (offline) trains a GPT-2, and its
    `rl export` (tied embeddings, Conv1D weights, learned positions) generates rl's own greedy
    validation responses through transformers alone."""
    from engine.export import export_checkpoint
    from tests.test_export import final_validation, held_out_prompts, hf_greedy

    fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-gpt2", model_dirs["gpt2"])
    run = tmp_path / "run"
    r = _rl(["train", "model.path=tiny-org/tiny-gpt2", "trainer.total_steps=2", "data.train_batch_size=8",
             "algorithm.rollout_n=4", "task.num_val=32", "trainer.val_freq=2", f"checkpoint.dir={run}"], tmp_path,
            {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    manifest = json.loads((run / "step_2" / "manifest.json").read_text())
    assert "models--tiny-org--tiny-gpt2/snapshots" in manifest["model"]["resolved_path"]
    result = export_checkpoint(run, out=tmp_path / "hf")
    assert result.model_type == "gpt2"
    assert hf_greedy(tmp_path / "hf", held_out_prompts()) == final_validation(run)["responses"]
