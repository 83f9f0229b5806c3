"""Bring-your-own data: files in each convention load through `datasets`, their format is
detected, message prompts become exactly the chat template's token ids, and bad prompts fail
naming the row and the fix."""

from __future__ import annotations

import json

import pytest

from engine.config.schema import RunConfig, TaskConfig
from engine.data.fingerprint import dataset_refusals, fingerprint_path, write_record
from engine.data.prompts import encode_split
from engine.errors import ConfigError
from engine.model.tokenizer import CharTokenizer, HFTokenizer
from engine.tasks.dataset import make_dataset_task
from tests.data_fixtures import (make_chat_tokenizer, trl_rows, verl_rows, write_saved_dataset, write_trl_jsonl,
                                 write_verl_parquet)

REWARDS = '''
def seen(prompt, response, answer, **row):
    return 1.0
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "fixture_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fixture_rewards:seen"


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return HFTokenizer(str(make_chat_tokenizer(tmp_path_factory.mktemp("tok"))))


def task_cfg(path, reward, **kw) -> TaskConfig:
    return TaskConfig(name="dataset", path=str(path), reward_fn=reward, **kw)


def test_verl_parquet_detected_and_rendered_with_chat_template(tmp_path, rewards_module, chat_tok):
    """A verl gsm8k-shaped Parquet: format verl detected, ground truth from reward_model, every
    column kept for the reward, and token ids equal apply_chat_template(messages, add_generation_prompt=True)."""
    path = write_verl_parquet(tmp_path / "train.parquet", 10)
    task = make_dataset_task(task_cfg(path, rewards_module, num_val=2), seed=0)
    assert task.data_info["format"] == "verl"
    assert len(task.train) + len(task.val) == 10 and len(task.val) == 2
    ex = task.train[0]
    row_index = int(ex.origin.rsplit(" ", 1)[1])
    original = verl_rows(10)[row_index]
    assert ex.answer == original["reward_model"]["ground_truth"]
    assert ex.row["reward_model"] == original["reward_model"] and ex.row["data_source"] == "openai/gsm8k"
    assert ex.row["extra_info"]["index"] == row_index and ex.row["ground_truth"] == ex.answer
    enc = encode_split(chat_tok, task.train, split="train", max_len=512, filter_overlong=False, chat_template=False)
    for ids, e in zip(enc.ids, enc.examples):
        want = chat_tok.tok.apply_chat_template(e.prompt, add_generation_prompt=True)["input_ids"]
        assert ids == list(want)
    assert chat_tok.tok.convert_ids_to_tokens(enc.ids[0])[-2:] == ["<|im_start|>", "assistant"]


def test_trl_conversational_jsonl(tmp_path, rewards_module, chat_tok):
    """TRL prompt-only conversational JSONL (with multi-turn history): detected as trl, the
    extra columns kept by name, ids equal the chat template's."""
    path = write_trl_jsonl(tmp_path / "chat.jsonl", 8)
    task = make_dataset_task(task_cfg(path, rewards_module, num_val=0), seed=0)
    assert task.data_info["format"] == "trl" and len(task.train) == 8
    by_origin = {e.origin: e for e in task.train}
    rows = trl_rows(8)
    e = by_origin["chat.jsonl row 3"]
    assert e.prompt == rows[3]["prompt"] and len(e.prompt) == 3
    assert e.row == {"solution": rows[3]["solution"], "difficulty": rows[3]["difficulty"]}
    ids = encode_split(chat_tok, [e], split="train", max_len=512, filter_overlong=False, chat_template=False).ids[0]
    assert ids == list(chat_tok.tok.apply_chat_template(e.prompt, add_generation_prompt=True)["input_ids"])


def test_save_to_disk_directory_with_splits(tmp_path, rewards_module):
    """A save_to_disk DatasetDict: task.split / task.val_split pick the splits; text format."""
    path = write_saved_dataset(tmp_path / "ds", 12, 4)
    cfg = task_cfg(path, rewards_module, prompt_key="question", split="train", val_split="test", num_val=3)
    task = make_dataset_task(cfg, seed=0)
    assert task.data_info["format"] == "text" and task.data_info["kind"] == "save_to_disk"
    assert [e.prompt for e in task.train] == [f"{i}+1=" for i in range(12)]
    assert [e.answer for e in task.val] == ["101", "102", "103"]
    assert task.train[0].row == {"level": 0}
    with pytest.raises(ConfigError, match=r"no split `tset`\. Did you mean `task.val_split=test`"):
        make_dataset_task(task_cfg(path, rewards_module, prompt_key="question", val_split="tset"), seed=0)


def test_jsonl_and_parquet_task_names_are_aliases(tmp_path, rewards_module):
    rows = [{"prompt": f"say {i}", "answer": str(i)} for i in range(6)]
    (tmp_path / "p.txt").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_dataset_task(TaskConfig(name="jsonl", path=str(tmp_path / "p.txt"), reward_fn=rewards_module,
                                        num_val=1), seed=0)
    assert task.data_info["format"] == "text" and len(task.train) == 5


def test_message_prompts_without_chat_template_name_the_row(tmp_path, rewards_module):
    """A model directory whose tokenizer has no chat template (and the tiny model's character
    tokenizer) cannot render message prompts: the error names the row and the fix."""
    path = write_trl_jsonl(tmp_path / "chat.jsonl", 4)
    task = make_dataset_task(task_cfg(path, rewards_module, num_val=0), seed=0)
    plain = HFTokenizer(str(make_chat_tokenizer(tmp_path / "plain", chat_template=False)))
    for tok, who in ((plain, "this tokenizer"), (CharTokenizer("abc"), "the tiny model's character tokenizer")):
        with pytest.raises(ConfigError, match=rf"chat\.jsonl row \d: the prompt is a list of chat messages, but "
                                              rf"{who} has no chat template.*model=smollm2-135m"):
            encode_split(tok, task.train, split="train", max_len=64, filter_overlong=False, chat_template=False)


@pytest.mark.parametrize("bad,match", [
    (7, r"bad.jsonl row 1: the prompt \(`prompt`\) is of type int \(7\)"),
    ("  ", r"row 1: the prompt \(`prompt`\) is empty"),
    (None, r"row 1: the prompt \(`prompt`\) is missing"),
])
def test_bad_prompts_fail_naming_the_row(tmp_path, rewards_module, bad, match):
    """Never a silent str(): a non-string, empty or missing prompt stops with its row."""
    rows = [{"prompt": "fine", "answer": "1"}, {"prompt": bad, "answer": "2"}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=match):
        make_dataset_task(task_cfg(tmp_path / "bad.jsonl", rewards_module, num_val=0), seed=0)


def test_overlong_prompts_refused_or_filtered(tmp_path, rewards_module):
    rows = [{"prompt": "x" * n, "answer": ""} for n in (5, 50, 6, 70)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_dataset_task(task_cfg(tmp_path / "p.jsonl", rewards_module, num_val=0), seed=0)
    tok = CharTokenizer("x")
    with pytest.raises(ConfigError, match=r"2 train prompts are longer than data.max_prompt_length=10 tokens "
                                          r"\(longest: p.jsonl row 3, 70 tokens\).*filter_overlong_prompts=true"):
        encode_split(tok, task.train, split="train", max_len=10, filter_overlong=False, chat_template=False)
    enc = encode_split(tok, task.train, split="train", max_len=10, filter_overlong=True, chat_template=False)
    assert sorted(len(i) for i in enc.ids) == [5, 6] and len(enc.dropped) == 2
    assert all(len(e.prompt) <= 10 for e in enc.examples)


def test_missing_path_and_uncached_name(tmp_path, rewards_module, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "dscache"))
    with pytest.raises(ConfigError, match="does not exist"):
        make_dataset_task(task_cfg(tmp_path / "nope.parquet", rewards_module), seed=0)
    with pytest.raises(ConfigError, match=r"no dataset `nobody/nothing`.*local Hugging Face cache \(looked in"):
        make_dataset_task(task_cfg("nobody/nothing", rewards_module), seed=0)


@pytest.mark.parametrize("kind", ["fifo", "device", "symlink_loop", "too_long"])
def test_special_task_paths_are_named_not_read(tmp_path, rewards_module, kind):
    """task.path as a FIFO (a read would wait forever), a device (/dev/zero), a symlink loop (all
    three were "does not exist") or a name too long (a traceback blamed on model=tiny): a
    ConfigError saying what the path is, raised before anything opens it."""
    import os
    import time

    p = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "symlink_loop":
        (tmp_path / "other").symlink_to(p)
        p.symlink_to(tmp_path / "other")
    elif kind == "too_long":
        p = tmp_path / ("d" * 5000)
    else:
        p = "/dev/zero"
    needle = {"fifo": "is a FIFO", "device": "is a device", "symlink_loop": "loops through symbolic links",
              "too_long": "too long"}[kind]
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=needle):
        make_dataset_task(task_cfg(p, rewards_module), seed=0)
    assert time.monotonic() - t0 < 5


def test_fingerprint_refuses_changed_dataset(tmp_path, rewards_module):
    """The run dir records the data's fingerprint; a changed file is refused on resume unless
    task.allow_dataset_change=true."""
    path = write_verl_parquet(tmp_path / "train.parquet", 6)
    task = make_dataset_task(task_cfg(path, rewards_module), seed=0)
    run = tmp_path / "run"
    run.mkdir()
    write_record(run, task.data_info)
    cfg = RunConfig(task=task_cfg(path, rewards_module))
    assert dataset_refusals(run, cfg) == []
    write_verl_parquet(path, 7)
    (why,) = dataset_refusals(run, cfg)
    assert "changed" in why and "task.allow_dataset_change=true" in why
    cfg.task.allow_dataset_change = True
    assert dataset_refusals(run, cfg) == []
    assert fingerprint_path(str(path)) != task.data_info["fingerprint"]


def test_fingerprint_is_xxh3_of_the_bytes(tmp_path):
    """A file's fingerprint is XXH3-128 over its name and bytes (issue 42 part 8: xxhash, already
    a dependency, not a hand-picked sha256); a directory's covers every file by relative path."""
    import xxhash

    f = tmp_path / "train.jsonl"
    f.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n')
    assert fingerprint_path(str(f)) == xxhash.xxh3_128(b"train.jsonl\0" + f.read_bytes() + b"\0").hexdigest()
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "b.jsonl").write_bytes(b"B")
    (d / "sub" / "a.jsonl").write_bytes(b"A")
    assert fingerprint_path(str(d)) == xxhash.xxh3_128(b"b.jsonl\0B\0sub/a.jsonl\0A\0").hexdigest()


def _old_record(run, path):
    """dataset.json as rl wrote it before XXH3: a sha256 digest and no fingerprint_algorithm."""
    import hashlib

    digest = hashlib.sha256(path.name.encode() + b"\0" + path.read_bytes() + b"\0").hexdigest()
    (run / "dataset.json").write_text(json.dumps({"format": "verl", "fingerprint": digest, "path": str(path),
                                                  "rows": {"train": 6, "val": 0}, "previous": []}))
    return digest


def test_a_sha256_record_from_before_xxh3_still_guards_resume(tmp_path, rewards_module):
    """Compatibility rule: a record without fingerprint_algorithm is sha256 and is compared by
    recomputing sha256, so an old run resumes on its unchanged data and is refused on changed
    data; the next record is XXH3, and unchanged data is not listed as a previous dataset."""
    path = write_verl_parquet(tmp_path / "train.parquet", 6)
    run = tmp_path / "run"
    run.mkdir()
    old = _old_record(run, path)
    cfg = RunConfig(task=task_cfg(path, rewards_module))
    assert dataset_refusals(run, cfg) == []  # same data, old digest
    task = make_dataset_task(task_cfg(path, rewards_module), seed=0)
    write_record(run, task.data_info)  # what the resumed run writes
    rec = json.loads((run / "dataset.json").read_text())
    assert rec["fingerprint_algorithm"] == "xxh3-128" and rec["fingerprint"] != old and rec["previous"] == []
    assert dataset_refusals(run, cfg) == []

    old = _old_record(run, path)
    write_verl_parquet(path, 7)
    (why,) = dataset_refusals(run, cfg)
    assert f"changed (fingerprint {old[:12]} -> " in why
    cfg.task.allow_dataset_change = True
    write_record(run, make_dataset_task(task_cfg(path, rewards_module), seed=0).data_info)
    rec = json.loads((run / "dataset.json").read_text())
    assert rec["previous"] == [{"fingerprint": old, "path": str(path), "rows": {"train": 6, "val": 0},
                                "fingerprint_algorithm": "sha256"}]


def test_a_record_in_an_unknown_algorithm_is_a_clear_error(tmp_path, rewards_module):
    path = write_verl_parquet(tmp_path / "train.parquet", 6)
    run = tmp_path / "run"
    run.mkdir()
    (run / "dataset.json").write_text(json.dumps({"fingerprint": "ab", "fingerprint_algorithm": "md7"}))
    with pytest.raises(ConfigError, match=r"fingerprint algorithm 'md7'.*known: xxh3-128, sha256"):
        dataset_refusals(run, RunConfig(task=task_cfg(path, rewards_module)))


def test_dataset_name_from_the_local_hub_cache(tmp_path):
    """`task.path=owner/name` loads, offline, a dataset present in the local Hugging Face hub
    cache (the layout `huggingface-cli download --repo-type dataset` leaves); its fingerprint is
    recorded like a file's."""
    import subprocess
    import sys

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "datasets--me--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    data = repo / "snapshots" / rev / "data"
    data.mkdir(parents=True)
    from datasets import Dataset

    Dataset.from_list([{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]).to_parquet(
        str(data / "train-00000-of-00001.parquet"))
    code = ("from engine.config.schema import TaskConfig\n"
            "from engine.tasks.dataset import make_dataset_task\n"
            "t = make_dataset_task(TaskConfig(name='dataset', path='me/tiny', reward_fn='rl:exact_match', num_val=1), 0)\n"
            "print(t.data_info['source'], len(t.train), len(t.val), bool(t.data_info['fingerprint']))\n")
    env = {**__import__("os").environ, "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["me/tiny", "(HF", "hub", "cache)", "4", "1", "True"]
