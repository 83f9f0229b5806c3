"""Reward models (``task.reward_model.*``): a tiny real LlamaForSequenceClassification saved
offline scores (prompt, response) exactly as a direct transformers forward of each text alone
does (batching and padding change nothing; long texts lose their start), the chat template is
applied as TRL applies it, directories that are not reward models are refused, and runs train
end to end with the model colocated and in a Ray actor, its score added to the task's rule by
weight and logged on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import ConfigError
from tiny_hf import char_tokenizer, hf_config, save_tiny_model  # the echo alphabet: "abcdefgh:", space
from tests.cli_utils import rl as run_rl


def save_reward_model(out: Path, num_labels: int = 1, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaForSequenceClassification

    tok = char_tokenizer()
    cfg = hf_config("llama", tok.vocab_size)
    cfg.num_labels = num_labels
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():  # a score head of visible size: the random init's is ~0.02 per weight
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm"))


def direct_scores(path: Path, texts: list[str], label: int = 0) -> list[float]:
    """Each text alone through transformers: no padding, no batch."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok.encode(t, add_special_tokens=False)])
            out.append(float(model(input_ids=ids).logits[0, label]))
    return out


def test_scores_equal_a_direct_forward_of_each_text_alone(rm_dir):
    from engine.reward_model.model import RewardModel

    pairs = [("abc:", "cba"), ("had a bad egg:", "a bag fed a dead bee"), ("h", ""), ("ace:", "dd")]
    rm = RewardModel(str(rm_dir), batch_size=3)  # two batches, the first padded to its longest text
    got = rm.score(pairs)
    want = direct_scores(rm_dir, [p + r for p, r in pairs])
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(g, 4) for g in got)) == 4  # the texts really score differently


def test_a_long_text_keeps_its_end(rm_dir):
    from engine.reward_model.model import RewardModel

    text = "abcdefgh: " * 3
    got = RewardModel(str(rm_dir), max_length=8).score([(text[:20], text[20:])])
    assert got == pytest.approx(direct_scores(rm_dir, [text[-8:]]), abs=1e-5)


def test_several_labels_score_by_label_index(tmp_path):
    from engine.reward_model.model import RewardModel

    path = save_reward_model(tmp_path / "rm3", num_labels=3)
    got = RewardModel(str(path), label_index=2).score([("a", "b"), ("cc", "dd eh")])
    assert got == pytest.approx(direct_scores(path, ["ab", "ccdd eh"], label=2), abs=1e-5)
    with pytest.raises(ConfigError, match=r"label_index=3`, but .* has 3 label\(s\)"):
        RewardModel(str(path), label_index=3)


def test_the_chat_template_is_applied_to_the_conversation(tmp_path):
    from transformers import AutoTokenizer

    from engine.reward_model.model import RewardModel

    path = save_reward_model(tmp_path / "rm")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    tok.save_pretrained(path)
    rm = RewardModel(str(path))
    assert rm.text("2+2=", "4") == "u:2+2=;a:4;"
    assert rm.text([{"role": "system", "content": "be"}, {"role": "user", "content": "q"}], "r") == "s:be;u:q;a:r;"
    assert rm.score([("2+2=", "4")]) == pytest.approx(direct_scores(path, ["u:2+2=;a:4;"]), abs=1e-5)


def test_refuses_what_is_not_a_reward_model(tmp_path):
    from engine.reward_model.model import resolve_reward_model

    lm = save_tiny_model("llama", tmp_path / "lm")
    with pytest.raises(ConfigError, match=r"is a LlamaForCausalLM, not a sequence classifier") as e:
        resolve_reward_model(str(lm))
    assert e.value.title == "not a reward model"
    with pytest.raises(ConfigError, match="directory without config.json"):
        resolve_reward_model(str(tmp_path))
    with pytest.raises(ConfigError, match="task.reward_model.path"):
        resolve_reward_model(str(tmp_path / "missing"))


def test_non_finite_scores_fail_the_batch_under_the_policy(rm_dir):
    """A model that returns nan: the batch fails; reward_on_error=zero scores it 0 and counts it."""
    from engine.config.schema import RewardModelConfig
    from engine.reward_model.colocated import ColocatedRewardModel
    from engine.rewards.call import Sample
    from engine.rewards.compute import RewardRunner

    sc = ColocatedRewardModel(RewardModelConfig(path=str(rm_dir)), "cpu")
    sc.load().score = lambda pairs: [float("nan")] * len(pairs)
    out = RewardRunner([], on_error="zero", scorers=[sc]).score([Sample("a", "b", "")])
    assert out.total == [0.0] and "must be finite" in out.failures[0].error


# ---- end to end --------------------------------------------------------------------------
def rl(*args, cwd=None, timeout=600):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, cwd=cwd, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "actor"])
def test_a_run_trains_with_a_reward_model_beside_the_task_rule(rm_dir, tmp_path, placement):
    r = rl("train", "task=echo", f"task.reward_model.path={rm_dir}", f"task.reward_model.placement={placement}",
           "task.reward_model.weight=0.5", "trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=2",
           "rollout.max_new_tokens=4", "trainer.val_freq=0", "checkpoint.dir=ck", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    where = "Ray actor on CPU" if placement == "actor" else "colocated"
    shown = "".join(c for c in r.stdout + r.stderr if c not in "│ \n")  # the plan table wraps lines
    assert f"0.5xreward_model{rm_dir}({where}".replace(" ", "") in shown
    assert "Loading weights" not in r.stderr
    rows = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        fns = row["reward_fns"]
        assert "reward_model" in fns and len(fns) == 2
        rule = next(v for k, v in fns.items() if k != "reward_model")
        assert fns["reward_model"] != 0.0
        assert row["reward_mean"] == pytest.approx(rule + 0.5 * fns["reward_model"], abs=1e-5)
