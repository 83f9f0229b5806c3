"""FSDP ranks other than 0 neither read nor hold the whole model: they build it on the meta
device and receive their shards from rank 0 (engine/backends/fsdp/rank0_weights.py). What the
ranks then train must be exactly the checkpoint's weights (or the seeded random init), buffers
included, on every rank."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config.load import load_run_config
from tests.dist_utils import run_ranks
from tests.tiny_hf import char_tokenizer, save_tiny_model


def _builds(rank, world, cases):
    """One spawn of two ranks builds every case (``(paths per rank, overrides)``) in turn."""
    return [_build(rank, world, paths, overrides) for paths, overrides in cases]


def _build(rank, world, paths, overrides):
    from engine.backends.fsdp import FSDPEngine

    tok = char_tokenizer()
    cfg = load_run_config(overrides).config
    eng = FSDPEngine(cfg, paths[rank], tok.vocab_size, tok.pad_token_id, tok.eos_token_id, torch.device("cpu"),
                     updates_per_step=1)
    eng.build()
    shards = {n: p.to_local().clone() for n, p in eng.model.named_parameters()}
    ref = None
    if eng.ref_model is not None:
        ref = {n: p.full_tensor().clone() for n, p in eng.ref_model.named_parameters()}
    critic = None
    if cfg.algorithm.name == "ppo":  # the worker builds it beside the engine (engine/trainer/worker.py)
        from engine.backends.fsdp.critic import FSDPCritic

        c = FSDPCritic(cfg, eng)
        critic = {"params": {n: p.full_tensor().clone() for n, p in c.model.named_parameters()},
                  "buffers": {n: b.clone() for n, b in c.model.named_buffers()}}
    kept = eng.export_hf_state_dict(keep=rank == 0)  # the rollout worker's sync: rank 0 keeps the copy
    return {"full": eng.export_hf_state_dict(), "kept": kept, "buffers": {n: b.clone() for n, b in eng.model.named_buffers()},
            "shards": shards, "ref": ref, "lora": eng.lora_reference, "critic": critic, "rng": torch.get_rng_state()}


def _weights_only_on_rank0(tmp_path, arch):
    """A model directory for rank 0 and a copy without its weight files for rank 1: a rank that
    tried to read weights would fail."""
    full = save_tiny_model(arch, tmp_path / arch)
    bare = tmp_path / f"{arch}-config-only"
    shutil.copytree(full, bare)
    for f in bare.glob("*.safetensors"):
        f.unlink()
    return full, bare


ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every case on the same two ranks (one spawn): the three architectures with a KL reference,
    a seeded random init, PPO's critic, and LoRA."""
    tmp = tmp_path_factory.mktemp("rank0")
    dirs = {arch: _weights_only_on_rank0(tmp, arch) for arch in ARCHS}
    cases = {arch: ([str(dirs[arch][0]), str(dirs[arch][1])], ["algorithm.kl_coef=0.01"]) for arch in ARCHS}
    cases["seeded"] = (["", ""], ["trainer.seed=3"])
    cases["ppo"] = ([str(dirs["llama"][0]), str(dirs["llama"][1])], ["algorithm=ppo"])
    has_peft = True
    try:
        import peft  # noqa: F401
    except ImportError:
        has_peft = False
    if has_peft:
        cases["lora"] = ([str(dirs["llama"][0]), str(dirs["llama"][1])], ["model.lora.rank=4"])
    results = run_ranks(_builds, 2, list(cases.values()))
    per_case = {name: [results[0][i], results[1][i]] for i, name in enumerate(cases)}
    return dirs, per_case


@pytest.mark.parametrize("arch", ARCHS)
def test_rank1_trains_the_checkpoints_weights_without_reading_them(built, arch):
    """qwen2 ties its head to the embedding; gpt2 has learned positions and its own layout;
    the reference model (kl_coef > 0) is filled the same way."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dirs, per_case = built
    full = dirs[arch][0]
    results = per_case[arch]
    saved = load_file(str(next(full.glob("*.safetensors"))))
    expected = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32)
    want = expected.state_dict()
    for r in results:
        assert r["full"].keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(r["full"][name], value), name
            if name in saved:  # the file's own values, not only transformers' reading of them
                assert torch.equal(r["full"][name], saved[name].float()), name
        for name, value in r["ref"].items():
            assert torch.equal(value, want[name]), name
        expected_buffers = dict(expected.named_buffers())
        assert r["buffers"].keys() == expected_buffers.keys()
        for name, value in expected_buffers.items():  # rotary inv_freq is in no state dict
            assert torch.equal(r["buffers"][name], value), name
    assert results[1]["kept"] == {} and results[0]["kept"].keys() == want.keys()
    assert all(torch.equal(results[0]["kept"][k], v) for k, v in want.items())
    # each rank holds its own half: the two shards of a weight are different rows of it
    name = next(n for n in results[0]["shards"] if n.endswith("weight") and results[0]["shards"][n].dim() == 2)
    assert not torch.equal(results[0]["shards"][name], results[1]["shards"][name])
    assert torch.equal(results[0]["rng"], results[1]["rng"])


def test_a_seeded_random_init_is_the_same_model_on_every_rank(built):
    """No model path: rank 0 draws the seeded init and the other rank trains the same values
    (before, each rank drew it itself)."""
    from engine.model.build import build_hf_model

    tok = char_tokenizer()
    cfg = load_run_config(["trainer.seed=3"]).config
    want = build_hf_model(cfg.model, "", tok.vocab_size, 3, tok.pad_token_id, tok.eos_token_id).float().state_dict()
    for r in built[1]["seeded"]:
        for name, value in want.items():
            assert torch.equal(r["full"][name], value), name


def test_lora_on_rank1_gets_rank0s_adapters_and_base_identity(built):
    """LoRA adapters are initialised on rank 0 (lora_A random) and their values and the base
    model's sha256, which a LoRA checkpoint records, are the same on both ranks."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from engine.model.build import train_pad_embedding
    from engine.model.lora import state_dict_sha256

    dirs, per_case = built
    r0, r1 = per_case["lora"]
    base = AutoModelForCausalLM.from_pretrained(dirs["llama"][0], dtype=torch.float32)
    train_pad_embedding(base)
    assert r0["lora"] == r1["lora"]
    assert r0["lora"]["base_sha256"] == state_dict_sha256(base)
    for name in r0["full"]:
        assert torch.equal(r0["full"][name], r1["full"][name]), name
    lora_a = [n for n in r0["shards"] if "lora_A" in n]
    assert lora_a and all(r0["shards"][n].abs().sum() > 0 for n in lora_a)


def test_ppo_critic_on_rank1_is_the_checkpoints_backbone_and_a_zero_head(built):
    """The critic (a value head on a copy of the policy's network) is filled from rank 0 too."""
    from transformers import AutoModelForCausalLM

    dirs, per_case = built
    lm = AutoModelForCausalLM.from_pretrained(dirs["llama"][0], dtype=torch.float32)
    backbone = lm.base_model
    for r in per_case["ppo"]:
        params, buffers = r["critic"]["params"], r["critic"]["buffers"]
        for name, value in backbone.state_dict().items():
            assert torch.equal(params[f"backbone.{name}"], value), name
        for name, value in backbone.named_buffers():
            assert torch.equal(buffers[f"backbone.{name}"], value), name
        assert not params["value_head.weight"].any() and not params["value_head.bias"].any()


def _build_fails(rank, world, paths):
    try:
        _build(rank, world, paths, [])
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), getattr(e, "title", None)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["pickled", "truncated"])
def test_when_rank0_cannot_read_the_model_every_rank_says_so(tmp_path, damage):
    """Only rank 0 reads the weights, so only its read can fail; the other ranks must fail with it
    (the same error: a UserError keeps its message and title) rather than wait in the broadcast
    for gloo's 30-minute timeout. pickled: weights that need a global to unpickle (refused
    unread, exit 2); truncated: a safetensors file cut short."""
    import os

    full, bare = _weights_only_on_rank0(tmp_path, "llama")
    weights = next(full.glob("*.safetensors"))
    if damage == "pickled":
        from safetensors.torch import load_file

        state = load_file(str(weights))
        weights.unlink()
        torch.save({**state, "extra": os.getcwd}, full / "pytorch_model.bin")
    else:
        weights.write_bytes(weights.read_bytes()[:1000])
    r0, r1 = run_ranks(_build_fails, 2, [str(full), str(bare)])
    assert r0 is not None and r1 is not None, (r0, r1)
    if damage == "pickled":
        assert r0[0] == r1[0] == "ConfigError" and r0[1:] == r1[1:] and r0[2] == "unsafe model", (r0, r1)
    else:
        assert r1[0] == "RuntimeError" and r1[1].startswith("rank 0 could not build the model:"), r1
