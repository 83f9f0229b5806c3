"""What users bring in: data files in the forms people really have (compressed, empty, malformed,
with a typo'd column name) and reward modules that fail to import. Each either loads, or stops
with one ConfigError naming the problem and the fix (never a traceback, never a silent default)."""

from __future__ import annotations

import bz2
import gzip
import json

import pytest

from engine.config.schema import TaskConfig
from engine.errors import ConfigError
from engine.rewards.spec import user_reward_specs
from engine.tasks.dataset import make_dataset_task

ROWS = [{"prompt": f"{c}:", "answer": c * 6} for c in "abcdefghij"]


@pytest.fixture
def reward(tmp_path, monkeypatch):
    (tmp_path / "audit_rewards.py").write_text("def r(prompt, response, answer, **row):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "audit_rewards:r"


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def task(path, reward, **kw):
    return make_dataset_task(TaskConfig(name="dataset", path=str(path), reward_fn=reward, num_val=0, **kw), seed=0)


@pytest.mark.parametrize("name,opener", [("t.jsonl.gz", gzip.open), ("t.JSONL.GZ", gzip.open),
                                         ("t.jsonl.bz2", bz2.open), ("t.json.gz", gzip.open)])
def test_compressed_jsonl_loads(tmp_path, reward, name, opener):
    """`datasets` reads compressed JSONL as it is; `t.jsonl.gz` was refused ("cannot tell the format")."""
    text = jsonl(ROWS) if ".jsonl" in name.lower() else json.dumps(ROWS)
    with opener(tmp_path / name, "wt") as f:
        f.write(text)
    t = task(tmp_path / name, reward)
    assert sorted((e.prompt, e.answer) for e in t.train) == [(r["prompt"], r["answer"]) for r in ROWS]


@pytest.mark.parametrize("name,text,why", [
    ("e.jsonl", "", "the file is empty"),
    ("blank.jsonl", "\n \n\n", "the file is empty"),
    ("h.csv", "prompt,answer\n", "only a header line"),
    ("l.json", "[]\n", "an empty JSON list"),
    ("o.json", "{}\n", r"an empty JSON object \(`\{\}`\), not rows: a JSON file holds a list of rows"),  # was "empty list"
    ("o.jsonl", "{}\n", r"an empty JSON object \(`\{\}`\), not rows: a JSON Lines file holds one row per line"),
])
def test_files_without_rows_say_so(tmp_path, reward, name, text, why):
    """An empty file was "Cannot read ...: StopIteration: StopIteration" or 'Instruction "train"
    corresponds to no data!'."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=rf"`task.path=.*{name}` has no rows: .*{why}") as e:
        task(tmp_path / name, reward)
    assert "StopIteration" not in e.value.message and "Instruction" not in e.value.message


def test_malformed_jsonl_names_the_parse_error(tmp_path, reward, capfd):
    """The parser's own message (what and which row), not datasets' wrapper "An error occurred
    while generating the dataset"; datasets' own log line of the same error ("Failed to load JSON
    from file ...", printed above rl's panel) is silenced, for JSON Lines and Parquet alike."""
    (tmp_path / "bad.jsonl").write_text(jsonl(ROWS[:1]) + "{not json\n")
    capfd.readouterr()
    with pytest.raises(ConfigError, match=r"Cannot read .*bad.jsonl: ArrowInvalid: JSON parse error: .* row 1\. "
                                          r"Check that it is valid JSON") as e:
        task(tmp_path / "bad.jsonl", reward)
    assert "DatasetGenerationError" not in e.value.message
    (tmp_path / "bad.parquet").write_text("not parquet\n")
    with pytest.raises(ConfigError, match=r"Cannot read .*bad.parquet: ArrowInvalid"):
        task(tmp_path / "bad.parquet", reward)
    err = capfd.readouterr().err
    assert "Failed to" not in err and "ArrowInvalid" not in err, err
    import logging

    assert logging.getLogger("datasets").getEffectiveLevel() <= logging.WARNING  # put back after the load


def test_typo_in_a_column_name_gets_did_you_mean(tmp_path, reward):
    """task.prompt_key with a typo named the columns but not the close one; task.answer_key with a
    typo was accepted silently and every answer was "" (the reward compared against nothing)."""
    (tmp_path / "q.jsonl").write_text(jsonl([{"question": r["prompt"], "solution": r["answer"]} for r in ROWS]))
    with pytest.raises(ConfigError, match=r"q.jsonl has no `questoin` column \(task.prompt_key\)\. Did you mean "
                                          r"`question`\? Columns: question, solution"):
        task(tmp_path / "q.jsonl", reward, prompt_key="questoin")
    with pytest.raises(ConfigError, match=r"has no `soluton` column \(task.answer_key\)\. Did you mean `solution`\?"):
        task(tmp_path / "q.jsonl", reward, prompt_key="question", answer_key="soluton")
    with pytest.raises(ConfigError, match=r"has no `Question` column.*Did you mean `question`\?"):
        task(tmp_path / "q.jsonl", reward, prompt_key="Question")
    ok = task(tmp_path / "q.jsonl", reward, prompt_key="question", answer_key="solution")
    assert all(e.answer == e.prompt[0] * 6 for e in ok.train)
    # the default answer column is optional (TRL rows carry their reference under any name)
    assert all(e.row["solution"] == e.prompt[0] * 6 and e.answer == ""
               for e in task(tmp_path / "q.jsonl", reward, prompt_key="question").train)


def test_messages_column_explains_the_prompt_layout(tmp_path, reward):
    """TRL's SFT layout ({"messages": [...]}) is not a prompt: the error says what RL needs."""
    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    (tmp_path / "m.jsonl").write_text(jsonl(rows))
    with pytest.raises(ConfigError, match=r"no `prompt` column.*`messages` column holds whole conversations.*"
                                          r"task.prompt_key=messages"):
        task(tmp_path / "m.jsonl", reward)


@pytest.mark.parametrize("source,match", [
    ("raise RuntimeError('no GPU here')\n", r"importing `bad_import` raised RuntimeError: no GPU here \(at "
                                            r".*bad_import.py:1\)\. Fix the module's top-level code"),
    ("def reward(prompt, response, answer:\n    return 1\n", r"`bad_import` has a syntax error: .*bad_import.py:1\)"),
    ("import sys\nsys.exit(3)\n", r"importing `bad_import` raised SystemExit: 3"),
    ("import not_installed_pkg_xyz\n", r"importing `bad_import` failed: it imports `not_installed_pkg_xyz`, which "
                                       r"is not installed .*\(at .*bad_import.py:1\)\. Install `not_installed_pkg_xyz`"),
    ("def rewards(prompt, response, answer):\n    return 1.0\n", r"`bad_import` has no function `reward`\. Did you "
                                                                  r"mean `bad_import:rewards`\?"),
    ("reward = 0.5\n", r"`bad_import` has `reward`, but it is a float, not a function"),
])
def test_reward_module_that_fails_to_import_is_a_config_error(tmp_path, monkeypatch, source, match):
    """A reward module whose top-level code raises (or exits, or has a syntax error) was a raw
    traceback from `rl train`; one that imports a missing package said "run rl from the
    directory that contains it" (it was found: its import is what is missing)."""
    (tmp_path / "bad_import.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("reward_fn", "correct_fn"):
        extra = {"reward_fn": "rl:exact_match"} if key == "correct_fn" else {}
        with pytest.raises(ConfigError, match=rf"`task.{key}=bad_import:reward`: " + match):
            user_reward_specs(TaskConfig(name="dataset", **{key: "bad_import:reward"}, **extra))
        import sys
        sys.modules.pop("bad_import", None)


# ---- model directories that cannot train: refused on the driver, not a traceback from a rank ----
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.tiny_hf import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("m") / "llama")


def broken_copy(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def _truncate(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _set_config(**kw):
    def edit(d):
        c = json.loads((d / "config.json").read_text())
        c.update(kw)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _negative_shape(d):
    """Rewrite the header with the first tensor's shape [-1, ...] (the data left as it is)."""
    import struct

    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["shape"] = [-1] + header[first]["shape"][1:]
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


@pytest.mark.parametrize("case,edit,match", [
    ("truncated", _truncate, r"model.safetensors is cut short: \d+ bytes of the \d+ its header describes"),
    ("bad_header", _negative_shape, r"model.safetensors has a broken header: tensor '.*' has shape \[-1"),
    ("empty", lambda d: (d / "model.safetensors").write_bytes(b""), r"model.safetensors is 0 bytes"),
    ("no_weights", lambda d: (d / "model.safetensors").unlink(), r"has no weights"),
    ("index", lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})),
     r"index.json names 1 weight file\(s\) that are not in .*model-00002-of-00002.safetensors"),
    ("encoder", _set_config(model_type="bert", architectures=["BertLMHeadModel"]),
     r"model_type='bert', an encoder.*is_decoder=true"),
])
def test_model_dir_that_cannot_load_is_refused_on_the_driver(tmp_path, llama_dir, case, edit, match):
    """A truncated/empty safetensors file, one whose header is malformed (`--dry-run` said ok) or a
    missing shard was a SafetensorError/OSError traceback from inside a rank; a BERT config (a causal-LM head in transformers' mapping) reached the
    sampler and failed there with an AttributeError."""
    from engine.model.source import check_architecture

    d = broken_copy(llama_dir, tmp_path / case, edit)
    with pytest.raises(ConfigError, match=match):
        check_architecture(d)
    check_architecture(str(llama_dir))  # the intact original passes


def test_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path, llama_dir):
    """A tokenizer whose ids reach past the model's vocab_size was an IndexError in the rank's
    embedding lookup."""
    from engine.model.source import check_vocab
    from engine.model.tokenizer import HFTokenizer

    tok = HFTokenizer(str(llama_dir))
    prompts = [tok.encode("a:"), [3, tok.vocab_size - 1]]
    check_vocab(str(llama_dir), tok, prompts)
    d = broken_copy(llama_dir, tmp_path / "small_vocab", _set_config(vocab_size=5))
    with pytest.raises(ConfigError, match=r"the tokenizer \(\d+ tokens\) makes ids the model cannot embed: a prompt "
                                          r"token has id \d+, but config.json says vocab_size=5"):
        check_vocab(d, tok, prompts)


def test_tokenizer_without_eos_uses_the_models_or_is_refused(tmp_path, llama_dir):
    """A tokenizer with no eos_token was `int(None)`: a TypeError traceback."""
    from engine.model.tokenizer import HFTokenizer

    def no_eos(d):
        t = json.loads((d / "tokenizer_config.json").read_text())
        t.pop("eos_token", None)
        (d / "tokenizer_config.json").write_text(json.dumps(t))
        for f in ("config.json", "generation_config.json"):
            if (d / f).exists():
                c = json.loads((d / f).read_text())
                c["eos_token_id"] = None
                (d / f).write_text(json.dumps(c))

    d = broken_copy(llama_dir, tmp_path / "no_eos", no_eos)
    with pytest.raises(ConfigError, match=r"the tokenizer has no end-of-sequence token"):
        HFTokenizer(d)
    _set_config(eos_token_id=[1, 7])(tmp_path / "no_eos")
    assert HFTokenizer(d).eos_token_id == 1


def test_rl_train_on_a_truncated_model_exits_2_without_a_traceback(tmp_path, llama_dir):
    """The real command: a model directory whose download was cut short stops before any rank
    starts (exit 2, one paragraph, no run directory), and a reward module that raises at import
    the same way."""
    from tests.cli_utils import rl

    d = broken_copy(llama_dir, tmp_path / "cut", _truncate)
    (tmp_path / "rewards_at_import.py").write_text("raise ImportError('needs a GPU', name='cuda_thing')\n")
    rows = tmp_path / "p.jsonl"
    rows.write_text(jsonl(ROWS))
    for args, needle in (([f"model.path={d}", "task.reward_fn=rl:exact_match"], "is cut short"),
                         (["task.reward_fn=rewards_at_import:r"], "importing `rewards_at_import` failed")):
        r = rl("train", "task=dataset", f"task.path={rows}", "checkpoint.dir=run", *args, cwd=tmp_path, timeout=300)
        flat = " ".join(r.stderr.replace("│", " ").split())
        assert r.returncode == 2 and "Traceback" not in r.stderr and needle in flat, r.stderr[-3000:]
        assert not (tmp_path / "run").exists()


def test_prompt_past_the_models_positions_is_refused(tmp_path, reward):
    """A model directory's context (GPT-2's n_positions=128) was not checked: a 291-token prompt
    reached the rank and GPT-2's learned position embedding raised IndexError (a traceback)."""
    from engine.config.load import load_run_config
    from engine.trainer.setup import prepare_inputs
    from tests.tiny_hf import save_tiny_model

    d = save_tiny_model("gpt2", tmp_path / "gpt2")
    (tmp_path / "long.jsonl").write_text(jsonl([{"prompt": "a" * (100 + 10 * i) + ":"} for i in range(20)]))
    args = ["task=dataset", f"task.path={tmp_path / 'long.jsonl'}", f"task.reward_fn={reward}", f"model.path={d}",
            "data.max_prompt_length=400"]
    with pytest.raises(ConfigError, match=r"prompt \(291 tokens\) \+ rollout.max_new_tokens \(12\) exceeds "
                                          r".*gpt2/config.json n_positions \(128\).*data.max_prompt_length=116 "
                                          r"data.filter_overlong_prompts=true"):
        prepare_inputs(load_run_config(args).config)
    ok = prepare_inputs(load_run_config(args + ["data.max_prompt_length=116",
                                                "data.filter_overlong_prompts=true"]).config)
    try:
        assert max(len(p) for p in ok.train_prompts + ok.val_prompts) + 12 <= 128
    finally:
        ok.rewards.close()


# ---- what users take out: `rl export` when the disk fills up -------------------------------------
def test_export_that_fills_the_disk_is_a_user_error_and_leaves_nothing(tmp_path):
    """`rl export --out <a full tmpfs>` was a SafetensorError traceback ("I/O error: No space left
    on device (os error 28)": safetensors' writer raises no OSError): now one UserError, the
    staging directory removed, and an existing --out (with --overwrite) left as it was."""
    import errno

    from engine.errors import UserError
    from engine.export.staging import staged_dir

    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"--out .*out: writing the export failed: the disk is full \(No space left "
                                        r"on device\)\. Nothing was left at --out;"):
        with staged_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"x" * 100)
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "keep.txt").write_text("old export")
    with pytest.raises(UserError, match=r"disk quota is exceeded .*\(the old directory is unchanged\)"):
        with staged_dir(out):
            raise RuntimeError("while saving") from OSError(errno.EDQUOT, "Disk quota exceeded")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "keep.txt").read_text() == "old export"
    with pytest.raises(ValueError, match="a bug"):  # not the file system's fault: not hidden
        with staged_dir(tmp_path / "other"):
            raise ValueError("a bug")
    assert not (tmp_path / "other").exists()


def test_export_stopped_by_sigterm_leaves_no_staging_directory(tmp_path):
    """`kill <rl export>` (SIGTERM, what job schedulers send) ended Python without its `finally`:
    the half-written `.<out>.tmp-*` directory (the model's size) stayed behind. Now SIGTERM while
    staging is SystemExit(143): nothing is left, and the previous handler is back afterwards."""
    import os
    import signal

    from engine.export.staging import staged_dir

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        with staged_dir(tmp_path / "out") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x" * 100)
            os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 143 and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before
    from engine import sigterm

    assert sigterm.received()  # what a run's shutdown reads (a killed run leaves its own Ray to ray.shutdown())
    with sigterm.sigterm_as_exit():
        assert not sigterm.received()  # the next command in this process starts unkilled


NUMPY_REWARDS = '''
import numpy as np

def np_batched(prompts, completions, **kw):
    return np.array([len(c) / 10 for c in completions])

def gen_batched(prompts, completions, **kw):
    return (1.0 for _ in completions)

def np_one_too_few(prompts, completions, **kw):
    return np.ones(len(prompts) - 1)

def huge(prompt, response, answer):
    return 10 ** 400
'''


def test_batched_reward_may_return_a_numpy_array(tmp_path, monkeypatch):
    """A TRL-style batched reward returning `np.array([...])` (or a generator) of the right length
    was refused with "returned 3 value(s) for a batch of 3"; an int too big for a float was an
    OverflowError blamed on rl's own as_score."""
    from engine.rewards.call import Sample
    from engine.rewards.compute import RewardError, RewardRunner
    from engine.rewards.spec import RewardFnSpec

    (tmp_path / "np_rewards.py").write_text(NUMPY_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = [Sample("p", "x" * n, "", {}, f"t.jsonl row {n}") for n in (1, 2, 3)]

    def score(name, batched=True):
        return RewardRunner([RewardFnSpec(name, f"np_rewards:{name}", 1.0, batched)]).score(samples)

    assert score("np_batched").total == pytest.approx([0.1, 0.2, 0.3])
    assert score("gen_batched").total == [1.0, 1.0, 1.0]
    with pytest.raises(RewardError, match=r"returned 2 value\(s\) for a batch of 3"):
        score("np_one_too_few")
    with pytest.raises(RewardError, match=r"bad return value: returned 1000.*, not a number a float can hold") as e:
        score("huge", batched=False)
    assert "OverflowError" not in e.value.message


def test_reward_given_as_a_file_path_is_loaded_from_that_file(tmp_path, monkeypatch):
    """verl names its reward by file (custom_reward_function.path): `task.reward_fn=./rewards.py:score`
    was a TypeError traceback, then a refusal naming the module to use instead (issue 42: accept it).
    A file path loads that file (relative to the current directory, absolute, or in a subdirectory,
    whose own imports resolve beside it), in the driver and in spawned reward workers alike; two
    files of the same name stay apart; a missing file is refused naming it."""
    from engine.rewards.compute import RewardRunner
    from engine.rewards.call import Sample

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "rewards.py").write_text("def score(prompt, response, answer):\n    return 1.0\n")
    (tmp_path / "sub" / "helper.py").write_text("BONUS = 2.0\n")
    (tmp_path / "sub" / "rewards.py").write_text("from helper import BONUS\n\n"
                                                "def score(prompt, response, answer):\n    return BONUS\n")
    samples = [Sample("p", "r", "a")]
    for spec, want in (("./rewards.py:score", 1.0), (f"{tmp_path}/rewards.py:score", 1.0),
                       ("sub/rewards.py:score", 2.0)):
        specs = user_reward_specs(TaskConfig(name="dataset", reward_fn=spec))
        assert specs[0].target.startswith(str(tmp_path)), specs[0].target
        assert RewardRunner(specs).score(samples).total == [want]
        pool = RewardRunner(specs, workers=1, timeout_s=60)
        try:
            assert pool.score(samples).total == [want]
        finally:
            pool.close()
    with pytest.raises(ConfigError, match=r"names the file .*nope\.py, which does not exist"):
        user_reward_specs(TaskConfig(name="dataset", reward_fn="./nope.py:score"))
    # a directory is said to be one (was "names the file sub, which does not exist"), with the .py files in it
    with pytest.raises(ConfigError, match=r"names sub .*which is a directory, not a Python file\. It holds "
                                          r"rewards\.py, helper\.py: e\.g\. `task\.reward_fn=\./sub/rewards\.py:score`"):
        user_reward_specs(TaskConfig(name="dataset", reward_fn="./sub:score"))


def test_export_never_takes_another_directorys_model_when_the_trained_one_is_gone(tmp_path, llama_dir,
                                                                                     monkeypatch):
    """The run trained `model.path=m/llama` (recorded as /abs/.../m/llama). Once that directory was
    gone, export resolved `m/llama` again from the current directory: another model there gave its
    config and tokenizer to the export silently (or a "hub id not cached, hf download m/llama"
    message). Now the recorded directory is named, and nothing else is read."""
    import shutil

    from engine.config.schema import ModelConfig, RunConfig
    from engine.errors import UserError
    from engine.export.base_model import base_dir

    trained = tmp_path / "a" / "m" / "llama"
    shutil.copytree(llama_dir, trained)
    shutil.copytree(llama_dir, tmp_path / "b" / "m" / "llama")  # a different place with the same relative name
    cfg = RunConfig(model=ModelConfig(path="m/llama"))
    manifest = {"model": {"resolved_path": str(trained)}}
    monkeypatch.chdir(tmp_path / "b")
    assert base_dir(manifest, cfg) == str(trained)
    shutil.rmtree(trained)
    with pytest.raises(UserError, match=rf"The model directory this run trained from, {trained} .* is gone"):
        base_dir(manifest, cfg)


def test_json_stdout_holds_only_the_json_while_rewards_print(capfd):
    """`rl train --json` with a reward function that prints (on the driver, or in a spawned reward
    worker) mixed those lines into stdout: `json.loads(stdout)` failed. While the run runs, stdout
    (the file descriptor, which child processes inherit) goes to stderr."""
    import os
    import subprocess
    import sys

    from rlcli.run_render import stdout_to_stderr

    with stdout_to_stderr(True):
        print("a reward's print")
        os.write(1, b"a library writing to fd 1\n")
        subprocess.run([sys.executable, "-c", "print('a reward worker process')"], check=True)
    print('{"steps_run": 1}')
    out, err = capfd.readouterr()
    assert out == '{"steps_run": 1}\n', (out, err)
    assert all(s in err for s in ("a reward's print", "a library writing to fd 1", "a reward worker process"))
    with stdout_to_stderr(False):
        print("plain")
    assert capfd.readouterr().out == "plain\n"


def test_directory_whose_extra_files_datasets_would_skip_is_refused(tmp_path, reward):
    """A directory with train.parquet beside extra.jsonl (or train.jsonl): `load_dataset(dir)`
    reads the split-named file and skips the rest silently; a run trained on a third of the data."""
    import datasets

    d = tmp_path / "data"
    d.mkdir()
    datasets.Dataset.from_list(ROWS[:4]).to_parquet(str(d / "train.parquet"))
    (d / "extra.jsonl").write_text(jsonl(ROWS[4:]))
    (d / "README.md").write_text("# my data\n")
    with pytest.raises(ConfigError, match=r"files named by split \(train\) and would skip extra.jsonl: their rows "
                                          r"would not be trained on"):
        task(d, reward)
    (d / "extra.jsonl").unlink()
    datasets.Dataset.from_list(ROWS[4:]).to_parquet(str(d / "test.parquet"))
    t = task(d, reward, val_split="test")
    assert len(t.train) == 4 and t.data_info["val_split"] == "test"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le"])
def test_utf16_file_says_to_save_it_as_utf8(tmp_path, reward, encoding):
    """A JSONL saved as UTF-16 (Windows tools do) was "JSON parse error: Invalid value. in row 0"."""
    (tmp_path / "w.jsonl").write_text(jsonl(ROWS), encoding=encoding)
    with pytest.raises(ConfigError, match=r"w.jsonl` is UTF-16 text; JSON/JSONL/CSV are read as UTF-8"):
        task(tmp_path / "w.jsonl", reward)
    (tmp_path / "ok.jsonl").write_text(jsonl(ROWS), encoding="utf-8-sig")  # a UTF-8 BOM is fine
    assert len(task(tmp_path / "ok.jsonl", reward).train) == len(ROWS)


def test_by_data_source_scores_verl_rows_as_verl_does_and_refuses_unknown_sources(tmp_path):
    """verl's data has no reward named in it: verl scores each row by its data_source. rl had no
    such rule, so a verl user had to write one; `rl:by_data_source` is it, and data it cannot score
    is refused before the run rather than at the first such row."""
    import json

    from engine.rewards.builtin import by_data_source
    from tests.cli_utils import cli, flat

    assert by_data_source("q", "so #### 72", "72", data_source="openai/gsm8k") == (1.0, True)
    assert by_data_source("q", r"\boxed{3}", "3", data_source="AIME_2024") == (1.0, True)
    assert by_data_source("q", r"\boxed{4}", "3", data_source="lighteval/MATH") == (0.0, False)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "data_source": "openai/gsm8k",
             "reward_model": {"ground_truth": str(i + 1), "style": "rule"}} for i in range(20)]
    (tmp_path / "ok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows[7]["data_source"] = "my/custom"
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", "task=dataset",
            "task.reward_fn=rl:by_data_source", "model=smollm2-135m"]
    assert cli(*base, f"task.path={tmp_path / 'ok.jsonl'}").exit_code == 0
    r = cli(*base, f"task.path={tmp_path / 'bad.jsonl'}")
    text = flat(r.stderr)
    assert r.exit_code == 2 and "my/custom" in text and "rl:by_data_source" in text, text
