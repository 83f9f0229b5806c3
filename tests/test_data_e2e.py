"""`rl train task=dataset` end to end through the CLI: accuracy for a file task, reward
failures (raise: clean stop with the last checkpoint intact; zero: counted), and `rl resume`
refusing a changed dataset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_utils import rl as run_rl

REWARDS = '''
import os

CALLS = 0

def first_char(prompt, response, answer, **row):
    return (float(response[:1] == answer[:1]), response.strip() == answer)

def length(prompt, response, answer, level):
    return min(len(response), 10) / 10 + 0 * level

def fails_at_step_3(prompt, response, answer, **row):
    global CALLS
    CALLS += 1
    if CALLS > 16:  # 8 samples per step: the first call of step 3
        raise ValueError(f"cannot score {response!r}")
    return 1.0

def hangs_once(prompt, response, answer, **row):
    marker = os.path.join(os.path.dirname(__file__), "hung.marker")
    try:  # atomic: with two workers calling at once, exactly one of them hangs
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return 1.0
    import time
    time.sleep(600)
    return 1.0
'''

SMALL = ["trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=2", "rollout.max_new_tokens=4"]


def rl(*args, cwd=None, timeout=600):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, cwd=cwd, timeout=timeout)


@pytest.fixture
def project(tmp_path):
    rows = [{"prompt": f"say {w}:", "answer": w, "level": i % 3} for i, w in enumerate(["hi", "ok", "yes", "no"] * 6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "myrewards.py").write_text(REWARDS)
    return tmp_path


@pytest.mark.slow
def test_file_task_reports_accuracy_and_each_reward(project):
    """Weighted reward functions (one returning (score, correct)) in a 2-process pool: the step
    rows carry each function's mean, validation writes per-problem results and accuracy, the plan
    names the detected format. A third function hangs on its first call (in the validation before
    step 1): with reward_on_error=zero its worker is killed, the call scores 0 and is counted, and
    the run finishes."""
    r = rl("train", "task=dataset", "task.path=train.jsonl", "task.reward_fns=[myrewards:first_char,myrewards:length,myrewards:hangs_once]",
           "task.reward_weights=[1.0,0.5,0.0]", "trainer.val_freq=2", "task.num_val=4", "task.reward_workers=2",
           "task.reward_timeout_s=5", "task.reward_on_error=zero",  # the hang is waited out: 5 s, not 15
           *SMALL, "checkpoint.dir=ck", "--json", cwd=project)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train.jsonl  (format text)" in r.stderr and "1 x myrewards:first_char + 0.5 x myrewards:length" in r.stderr
    rows = [json.loads(x) for x in (project / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[0]["reward_fns"]) == {"myrewards:first_char", "myrewards:length", "myrewards:hangs_once"}
    assert [x["reward_failures"] for x in rows] == [0, 0] and "rfail" in r.stderr
    assert rows[0]["reward_fns"]["myrewards:hangs_once"] == 1.0
    assert rows[0]["accuracy"] is not None
    assert rows[0]["reward_mean"] == pytest.approx(rows[0]["reward_fns"]["myrewards:first_char"]
                                                   + 0.5 * rows[0]["reward_fns"]["myrewards:length"])
    vals = [json.loads(x) for x in (project / "ck" / "validation.jsonl").read_text().splitlines()]
    assert vals and all(v["accuracy"] is not None and len(v["correct"]) == 4 and len(v["rewards"]) == 4
                        for v in vals)
    assert [v["reward_failures"] for v in vals] == [1, 0] and "1 reward calls failed (scored 0)" in r.stderr
    record = json.loads((project / "ck" / "dataset.json").read_text())
    assert record["format"] == "text" and record["fingerprint_algorithm"] == "xxh3-128"
    assert len(record["fingerprint"]) == 32


@pytest.mark.slow
def test_raising_reward_stops_cleanly_with_last_checkpoint_intact(project):
    r = rl("train", "task=dataset", "task.path=train.jsonl", "task.reward_fn=myrewards:fails_at_step_3",
           "trainer.total_steps=4", "checkpoint.save_freq=2", *SMALL[1:], "checkpoint.dir=ck", cwd=project)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert "reward function `myrewards:fails_at_step_3` failed on train.jsonl row" in err
    unwrapped = "".join(c for c in r.stderr if c not in "│ \n")  # a long path wraps inside the panel
    assert "ValueError: cannot score" in err and "myrewards.py" in unwrapped, err
    assert "step_2, is intact" in err and "rl resume" in err
    assert (project / "ck" / "step_2" / "manifest.json").exists()
    plan = rl("resume", "ck", "--dry-run", "--json", cwd=project)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["step"] == 2


@pytest.mark.slow
def test_resume_from_another_directory_then_refuses_a_changed_dataset(project, tmp_path_factory):
    """One run, resumed twice.

    From elsewhere (a scheduler script in $HOME): the relative dataset path was re-read from the
    new directory ("does not exist", or another file of that name), and the reward module's
    import error did not say where the run had started. Now the path is read from the start
    directory, and the reward module, still imported from the current directory only, is refused
    naming it.

    Then the dataset changes under the run: `rl resume` refuses it, and continues only with
    task.allow_dataset_change=true, keeping the original fingerprint."""
    args = ["task=dataset", "task.path=train.jsonl", "task.reward_fn=myrewards:first_char", *SMALL]
    r = rl("train", *args, "checkpoint.dir=ck", cwd=project)
    assert r.returncode == 0, r.stderr[-3000:]
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "train.jsonl").write_text('{"prompt": "other", "answer": "file"}\n')  # same name, other data
    refused = rl("resume", str(project / "ck"), "trainer.total_steps=3", cwd=elsewhere)
    err = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    unwrapped = "".join(c for c in refused.stderr if c not in "│ \n")  # a long path wraps inside the panel
    assert "myrewards:first_char" in unwrapped and "cannotbeimportedfromhere" in unwrapped, err
    assert f"cd{project}&&rlresume{project}/ck".replace(" ", "") in unwrapped, err  # spaces dropped on both sides
    import os
    env = dict(os.environ, PYTHONPATH=str(project))
    ok = subprocess.run([sys.executable, "-m", "rlcli.main", "resume", str(project / "ck"), "trainer.total_steps=3",
                         "--json"], capture_output=True, text=True, cwd=elsewhere, env=env, timeout=600)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert json.loads(ok.stdout)["last_step"] == 3
    assert "itsrelativepathsarereadfromthere" in "".join(c for c in ok.stderr if c not in "│ \n"), ok.stderr
    manifest = json.loads((project / "ck" / "step_3" / "manifest.json").read_text())
    assert manifest["config"]["task"]["path"] == str(project / "train.jsonl")

    with open(project / "train.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "say new:", "answer": "new", "level": 0}) + "\n")
    refused = rl("resume", "ck", "trainer.total_steps=4", cwd=project)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    flat_err = "".join(c for c in refused.stderr if c not in "│ \n")
    assert "changed(fingerprint" in flat_err and "task.allow_dataset_change=true" in flat_err, refused.stderr
    ok = rl("resume", "ck", "trainer.total_steps=4", "task.allow_dataset_change=true", "--json", cwd=project)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert json.loads(ok.stdout)["last_step"] == 4
    record = json.loads((project / "ck" / "dataset.json").read_text())
    assert len(record["previous"]) == 1  # the original fingerprint is kept


@pytest.mark.slow
def test_verl_parquet_with_chat_prompts_trains_on_a_real_hf_model(tmp_path):
    """verl gsm8k-shaped Parquet (message prompts) on a small Llama saved with a real HF tokenizer
    and chat template: the plan shows format verl, the built-in rl:gsm8k reward scores it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.data_fixtures import make_chat_tokenizer, write_verl_parquet

    model_dir = make_chat_tokenizer(tmp_path / "model")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                     ).save_pretrained(str(model_dir))
    write_verl_parquet(tmp_path / "train.parquet", 12)
    r = rl("train", "task=dataset", "task.path=train.parquet", "task.reward_fn=rl:gsm8k", f"model.path={model_dir}",
           *SMALL, "checkpoint.dir=ck", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train.parquet  (format verl)" in r.stderr
    rows = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(x["accuracy"] is not None for x in rows)
