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


# ---- nothing in a model directory runs code (docs/security.md, "Model directories") --------
EVIL_PY = "open({marker!r}, 'w').write('ran')\nfrom transformers import {base}\nclass {cls}({base}):\n    pass\n"


def _custom_code_dir(tmp_path: Path, which: str) -> tuple[Path, Path]:
    """A real tiny llama directory whose config (``which="model"``) or tokenizer config
    (``which="tokenizer"``) names a class that exists only in the directory's own evil.py,
    which creates a marker file when imported."""
    d, marker = save_tiny_model("llama", tmp_path / f"custom_{which}"), tmp_path / f"PWNED_{which}"
    if which == "model":
        c = json.loads((d / "config.json").read_text())
        c.update(model_type="evilarch", auto_map={"AutoConfig": "evil.EvilConfig",
                                                  "AutoModelForCausalLM": "evil.EvilModel"})
        (d / "config.json").write_text(json.dumps(c))
        (d / "evil.py").write_text(EVIL_PY.format(marker=str(marker), base="LlamaConfig", cls="EvilConfig"))
    else:
        t = json.loads((d / "tokenizer_config.json").read_text())
        t.update(tokenizer_class="EvilTok", auto_map={"AutoTokenizer": ["evil.EvilTok", "evil.EvilTok"]})
        (d / "tokenizer_config.json").write_text(json.dumps(t))
        (d / "evil.py").write_text(EVIL_PY.format(marker=str(marker), base="PreTrainedTokenizerFast", cls="EvilTok"))
    return d, marker


@pytest.mark.parametrize("which", ["model", "tokenizer"])
def test_model_dir_that_needs_its_own_code_is_refused_without_importing_it(which, tmp_path):
    """A model.path whose model or tokenizer class exists only as the directory's custom code
    (auto_map): refused on the driver with a clear ConfigError, the code never imported. Before,
    the tokenizer case made transformers prompt "run the custom code? [y/N]" on a terminal
    and `y` ran it; the loaders also pass trust_remote_code=False now (no prompt, no import)."""
    from transformers import AutoTokenizer

    from engine.errors import ConfigError
    from engine.model.source import HF_LOAD_KWARGS, check_architecture

    d, marker = _custom_code_dir(tmp_path, which)
    with pytest.raises(ConfigError, match="needs custom code") as e:
        check_architecture(str(d))
    assert ("tokenizer_config.json" if which == "tokenizer" else "config.json") in e.value.message
    if which == "tokenizer":
        with pytest.raises(ValueError):  # the loaders' own guard: never imports evil.py, never prompts
            AutoTokenizer.from_pretrained(str(d), **HF_LOAD_KWARGS)
    assert not marker.exists()


def test_auto_map_beside_a_known_architecture_is_ignored_not_run(tmp_path):
    """auto_map in a directory transformers can load with its own classes (the common case for
    hub models that ship optional code): accepted, and the code is never imported."""
    from engine.model.source import check_architecture
    from engine.model.tokenizer import HFTokenizer

    d, marker = _custom_code_dir(tmp_path, "tokenizer")
    t = json.loads((d / "tokenizer_config.json").read_text())
    t["tokenizer_class"] = "PreTrainedTokenizerFast"
    (d / "tokenizer_config.json").write_text(json.dumps(t))
    check_architecture(str(d))
    assert HFTokenizer(str(d)).vocab_size > 0
    assert not marker.exists()


def test_pickled_weights_that_run_code_are_refused_before_loading(tmp_path):
    """pytorch_model.bin holding a pickle that calls os.system: refused on the driver by the
    restricted unpickler (ConfigError naming the file, marker never created); a legacy-format
    (non-zip) one, which the pre-check leaves to transformers, is refused by its
    weights_only=True load as a ConfigError, not a traceback from a rank. A plain state_dict
    .bin passes."""
    from safetensors.torch import load_file

    from engine.config.schema import ModelConfig
    from engine.errors import ConfigError
    from engine.model.build import build_hf_model
    from engine.model.source import check_architecture
    from tests.ckpt_tools import RunsCode

    d = save_tiny_model("llama", tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    check_architecture(str(d))  # the control: a real state_dict pickle is plain data
    marker = tmp_path / "PWNED"
    torch.save({**sd, "evil": RunsCode(marker)}, d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="posix.system") as e:
        check_architecture(str(d))
    assert str(d / "pytorch_model.bin") in e.value.message
    torch.save({**sd, "evil": RunsCode(marker)}, d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    check_architecture(str(d))
    with pytest.raises(ConfigError, match="posix.system"):
        build_hf_model(ModelConfig(), str(d), char_tokenizer().vocab_size, 0)
    assert not marker.exists()


def test_every_from_pretrained_in_engine_refuses_remote_code():
    """Every ``*.from_pretrained(...)`` call in engine/ passes ``**HF_LOAD_KWARGS``
    (trust_remote_code=False, local files only) -- except GenerationConfig, which reads JSON."""
    import ast

    bad = []
    for f in sorted((REPO / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "from_pretrained":
                owner = getattr(node.func.value, "id", "")
                ok = any(k.arg is None and getattr(k.value, "id", "") == "HF_LOAD_KWARGS" for k in node.keywords)
                if not ok and owner != "GenerationConfig":
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno} {owner}.from_pretrained")
    assert not bad, bad


def test_a_bf16_checkpoint_read_straight_into_fp32_masters_equals_upcasting_it(tmp_path):
    """The FSDP engine keeps fp32 masters: it reads a bf16 checkpoint straight into fp32
    (``load_dtype``) rather than holding the bf16 model and its fp32 copy at once on every rank.
    Upcasting is exact, so the weights must equal loading bf16 and calling .float()."""
    from transformers import AutoModelForCausalLM

    from engine.config.schema import ModelConfig
    from engine.model.build import build_hf_model

    src = save_tiny_model("llama", tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    cfg = ModelConfig(dtype="bfloat16")
    direct = build_hf_model(cfg, str(tmp_path / "bf16"), 0, 0, load_dtype=torch.float32)
    upcast = build_hf_model(cfg, str(tmp_path / "bf16"), 0, 0).float()
    a, b = direct.state_dict(), upcast.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == torch.float32 for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert next(build_hf_model(cfg, str(tmp_path / "bf16"), 0, 0).parameters()).dtype == torch.bfloat16
