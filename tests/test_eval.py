"""`rl eval PATH`: pass@k by the unbiased estimator (checked against enumerating every k-subset);
a trained checkpoint evaluated greedily reproduces the run's own held-out validation, and its
`rl export` output gives the same rows; a save_pretrained directory's greedy responses are what
transformers' own generate() produces; eval.jsonl holds every response, scored by the task's
reward function; per data source numbers are the means of their rows; bad inputs exit 2 with
one paragraph and no traceback."""

from __future__ import annotations

import itertools
import os
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tests.cli_utils import cli, flat
from tests.cli_utils import rl as rl_proc
from tests.test_completion import _bash_protocol, _run_rl, rl_bin, workdir  # noqa: F401 (fixtures)
from tests.test_export import RL_ENV, RUN, final_validation, hf_greedy, rl


# ---------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------

def _enumerated(n: int, c: int, k: int) -> Fraction:
    """pass@k by definition: the share of the C(n, k) k-subsets of the n samples that hold at least
    one of the c correct ones."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_sample():
    from engine.evaluate.pass_at_k import pass_at_k

    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_enumerated(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_known_values_and_large_n():
    """pass@1 = c/n; no correct sample -> 0; pass@n = 1 with any correct sample; and at n=200 (where
    C(n, k) has ~60 digits) the product form equals the exact ratio of binomials."""
    from engine.evaluate.pass_at_k import default_ks, mean_pass_at_k, pass_at_k

    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 1, 10) == 1.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2)/C(4,2) = 1/6
    for c, k in ((3, 100), (1, 1), (50, 10), (0, 7), (199, 2)):
        exact = 1 - Fraction(math.comb(200 - c, k), math.comb(200, k))
        assert pass_at_k(200, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), (c, k)
    assert mean_pass_at_k([(4, 0), (4, 4)], 1) == pytest.approx(0.5)
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(5) == [1, 2, 4, 5] and default_ks(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


# ---------------------------------------------------------------------------------------------
# A Hugging Face directory written by save_pretrained
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from tests.tiny_hf import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("hf") / "llama", seed=3)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_save_pretrained_dir_greedy_is_transformers_generate_and_rows_are_scored_by_the_task(hf_dir, tmp_path):
    """The greedy pass's responses equal transformers' generate(do_sample=False) one prompt at a
    time; eval.jsonl has one line per response (greedy + n sampled per prompt), each with the reward
    the echo task's own function gives it; the table's numbers are the means of those rows, and
    pass@k is the estimator over each prompt's correct count."""
    from engine.evaluate import evaluate
    from engine.evaluate.pass_at_k import pass_at_k
    from engine.tasks.builtin import echo_correct, echo_reward

    out = tmp_path / "eval.jsonl"
    r = evaluate(str(hf_dir), ["task.num_val=24", "eval.n=4", "eval.temperature=1.5", f"eval.output={out}"])
    rows = _rows(out)
    greedy = [x for x in rows if x["eval"] == "greedy"]
    sampled = [x for x in rows if x["eval"] == "sampled"]
    assert len(greedy) == 24 and len(sampled) == 24 * 4 and r.responses == len(rows) == 120
    assert [x["response"] for x in greedy] == hf_greedy(hf_dir, [x["prompt"] for x in greedy])
    for x in rows:
        assert x["reward"] == pytest.approx(echo_reward(x["prompt"], x["response"], x["answer"]))
        assert x["correct"] == echo_correct(x["prompt"], x["response"], x["answer"])
        assert x["data_source"] == "echo"
    assert r.source["kind"] == "hf" and r.source["config_from"] == "defaults"
    assert r.overall.greedy_reward == pytest.approx(sum(x["reward"] for x in greedy) / 24)
    assert r.overall.sampled_reward == pytest.approx(sum(x["reward"] for x in sampled) / 96)
    assert r.k == [1, 2, 4]
    counts = [sum(x["correct"] for x in sampled if x["index"] == i) for i in range(24)]
    for k in r.k:
        assert r.overall.pass_at_k[k] == pytest.approx(sum(pass_at_k(4, c, k) for c in counts) / 24)
    assert r.overall.pass_at_k[1] == pytest.approx(r.overall.sampled_accuracy)
    # sampled responses differ from greedy ones somewhere (a sampler that ignored eval.n/temperature would not)
    assert {x["response"] for x in sampled} - {x["response"] for x in greedy}


def test_per_data_source_numbers_are_the_means_of_their_rows(hf_dir, tmp_path):
    """A dataset whose rows carry a data_source: one row of the table per source, each the mean of
    its own responses; a reward function that returns a float (no correctness) counts a response
    correct at reward >= eval.pass_threshold."""
    from engine.evaluate import evaluate

    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for i, c in enumerate("abcdefghabcdefgh"):
            f.write(json.dumps({"prompt": f"{c}:", "answer": c * 6, "data_source": "odd" if i % 2 else "even"}) + "\n")
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def first_letter(prompt, response, answer, **row):\n"
                       "    return 1.0 if response[:1] == answer[:1] else 0.25 * len(set(response) & set(answer))\n")
    out = tmp_path / "eval.jsonl"
    r = evaluate(str(hf_dir), ["task=dataset", f"task.path={data}", f"task.reward_fn={rewards}:first_letter",
                               "eval.split=train", "eval.n=2", "eval.pass_threshold=0.25", f"eval.output={out}"])
    rows = _rows(out)
    assert r.correct_from == "reward >= 0.25"
    assert [s.data_source for s in r.by_source] == ["even", "odd"]
    for s in r.by_source:
        mine = [x for x in rows if x["data_source"] == s.data_source]
        g = [x for x in mine if x["eval"] == "greedy"]
        assert s.prompts == len(g) and s.prompts > 0
        assert s.greedy_reward == pytest.approx(sum(x["reward"] for x in g) / len(g))
        assert s.greedy_accuracy == pytest.approx(sum(x["reward"] >= 0.25 for x in g) / len(g))
        assert all(x["correct"] == (x["reward"] >= 0.25) for x in mine)
    assert r.overall.prompts == sum(s.prompts for s in r.by_source) == r.prompts


def test_json_schema(hf_dir, tmp_path):
    """`rl eval --json`: one JSON document on stdout with the model, the passes, overall and per
    data source numbers and where the rows went."""
    out = tmp_path / "e.jsonl"
    r = cli("eval", str(hf_dir), "task.num_val=8", "eval.n=2", "eval.k=[1,2]", f"eval.output={out}", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) >= {"version", "source", "task", "split", "prompts", "reward", "correct_from", "sampling",
                        "overall", "by_data_source", "responses", "reward_failures", "output", "seconds"}
    assert doc["source"]["kind"] == "hf" and doc["task"] == "echo" and doc["prompts"] == 8
    assert doc["sampling"] == {"greedy": True, "n": 2, "k": [1, 2], "temperature": 1.0, "top_p": 1.0,
                               "max_new_tokens": 12, "sampler": "torch", "device": "cpu"}
    o = doc["overall"]
    assert set(o) == {"data_source", "prompts", "greedy", "sampled"}
    assert set(o["greedy"]) == {"accuracy", "reward"} and set(o["sampled"]["pass_at_k"]) == {"1", "2"}
    assert doc["responses"] == 8 * 3 == len(out.read_text().splitlines()) and doc["output"] == str(out)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------

def _refused(r, *needles: str) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    text = flat(r.stderr)
    for n in needles:
        assert n in text, text
    return text


def test_bad_inputs_exit_2_with_the_fix_and_write_nothing(hf_dir, tmp_path):
    out = tmp_path / "eval.jsonl"
    o = f"eval.output={out}"
    _refused(cli("eval", str(tmp_path / "missing"), o), "does not exist", "rl export", "save_pretrained")
    (tmp_path / "a.txt").write_text("x")
    _refused(cli("eval", str(tmp_path / "a.txt"), o), "is a regular file", "Hugging Face causal-LM directory")
    (tmp_path / "empty").mkdir()
    _refused(cli("eval", str(tmp_path / "empty"), o), "is not an rl checkpoint", "Hugging Face causal-LM directory")
    _refused(cli("eval", str(hf_dir), o, "optim.lr=1e-3"), "`optim.lr=1e-3` has no effect on `rl eval`")
    _refused(cli("eval", str(hf_dir), o, "--engine", "megatron"))  # no such option
    _refused(cli("eval", str(hf_dir), o, "engine=megatron"), "the engine group is not used")
    _refused(cli("eval", str(hf_dir), o, "eval.n=2", "eval.k=[1,4]"), "pass@4 needs at least 4", "eval.n=2")
    _refused(cli("eval", str(hf_dir), o, "eval.greedy=false"), "evaluates nothing")
    _refused(cli("eval", str(hf_dir), o, "task.path=x.jsonl"), "is a dataset key", "task=dataset")
    _refused(cli("eval", str(hf_dir), o, "eval.nn=2"), "eval.n")  # did you mean
    # a response longer than the trainer's token budget: eval trains nothing, so the advice is the
    # model's positions and rollout.max_new_tokens, never engine.max_tokens_per_micro_batch (which eval refuses)
    text = _refused(cli("eval", str(hf_dir), o, "rollout.max_new_tokens=100000"), "no positions past",
                    "Lower rollout.max_new_tokens (at most")
    assert "engine." not in text and "data.max_prompt_length=" not in text, text
    # eval's overrides read nan as text: the same refusal as `rl train optim.lr=nan` (was "must be a number; got 'nan'")
    _refused(cli("eval", str(hf_dir), o, "eval.pass_threshold=nan"),
             "`eval.pass_threshold` must be a finite number (nan and inf are not); got nan.")
    # a held-out split that is empty says why: task.num_val=0, or data too small for the share rule
    _refused(cli("eval", str(hf_dir), o, "task.num_val=0"), "task.num_val=0", "eval.split=train")
    small = tmp_path / "four.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    text = _refused(cli("eval", str(hf_dir), o, "task=dataset", f"task.path={small}", "task.reward_fn=rl:exact_match"),
                    "it has 4 rows", "rows // 5", "task.val_split", "eval.split=train")
    assert "hold prompts out (task.num_val=64)" not in text, text
    _refused(cli("train", "eval.n=2", f"checkpoint.dir={tmp_path / 'run'}"), "read by `rl eval`, not by `rl train`")
    assert not out.exists() and not (tmp_path / "run").exists()
    # an existing file that an earlier rl eval did not write is never replaced
    mine = tmp_path / "notes.jsonl"
    mine.write_text('{"my": "data"}\n')
    _refused(cli("eval", str(hf_dir), f"eval.output={mine}"), "already exists", "not a file an earlier `rl eval`")
    assert mine.read_text() == '{"my": "data"}\n'
    # a model directory whose weights are cut short
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[: 100] if f.suffix == ".safetensors" else f.read_bytes())
    _refused(cli("eval", str(broken), o), "is cut short", "save_pretrained")
    assert not out.exists()


def test_an_earlier_eval_output_is_replaced_whole(hf_dir, tmp_path):
    from engine.evaluate import evaluate

    out = tmp_path / "eval.jsonl"
    evaluate(str(hf_dir), ["task.num_val=4", f"eval.output={out}"])
    assert len(out.read_text().splitlines()) == 4
    evaluate(str(hf_dir), ["task.num_val=2", f"eval.output={out}"])
    assert len(out.read_text().splitlines()) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["eval.jsonl"]  # no temporary file left


# ---------------------------------------------------------------------------------------------
# A trained checkpoint and its export
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("evalrun") / "run"
    r = rl("train", *RUN, f"checkpoint.dir={run}", "task=sort")
    assert r.returncode == 0, r.stderr[-4000:]
    return run


@pytest.mark.slow
def test_checkpoint_and_its_export_reproduce_the_runs_own_validation(trained_run, tmp_path):
    """`rl eval ckpt/` (no overrides) evaluates the run's task (sort, from the manifest) on the
    run's held-out prompts: its greedy responses and accuracy are exactly the trainer's own final
    validation at that step; `rl export` of the same step evaluates to the same rows."""
    val = final_validation(trained_run)
    a, b = tmp_path / "ckpt.jsonl", tmp_path / "export.jsonl"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    orphan = tmp / "rl-eval-killed"  # what an eval killed mid-way leaves: its owner's lock is free
    (orphan / "hf").mkdir(parents=True)
    (orphan / "hf" / "model.safetensors").write_bytes(b"x" * 1000)
    (orphan / ".owner.lock").write_text("")
    os.utime(orphan / ".owner.lock", (0, 0))
    r = rl_proc("eval", str(trained_run), f"eval.output={a}", "--json", cwd=tmp_path,
                env={**RL_ENV, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["source"]["kind"] == "checkpoint" and doc["source"]["step"] == 2 and doc["task"] == "sort"
    assert doc["source"]["config_from"].endswith("step_2/manifest.json")
    assert not list(tmp.glob("rl-eval-*"))  # the temporary export is gone, and the killed eval's
    rows = _rows(a)
    assert [x["response"] for x in rows] == val["responses"]
    assert doc["overall"]["greedy"]["accuracy"] == pytest.approx(val["accuracy"])
    assert doc["overall"]["greedy"]["reward"] == pytest.approx(val["reward"])
    r = rl("export", str(trained_run), "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = rl("eval", str(tmp_path / "hf"), f"eval.output={b}", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc2 = json.loads(r.stdout)
    assert doc2["source"]["kind"] == "export" and doc2["task"] == "sort" and doc2["source"]["step"] == 2
    assert _rows(b) == rows
    assert doc2["overall"] == doc["overall"]


@pytest.mark.slow
def test_checkpoint_table_and_step_dir(trained_run, tmp_path):
    """The rich table names the step evaluated and the numbers; a step_N directory is taken as is."""
    r = rl("eval", str(trained_run / "step_2"), "eval.n=2", f"eval.output={tmp_path / 'e.jsonl'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    text = flat(r.stdout)
    assert "step_2 (step 2)" in text and "rl checkpoint" in text and "pass@2" in text and "sort" in text, text
    # eval.* keys on `rl resume` are refused naming rl eval (they would do nothing there)
    r = cli("resume", str(trained_run), "trainer.total_steps=4", "eval.n=2", "--dry-run")
    assert r.exit_code == 2 and "read by `rl eval`, not by training" in flat(r.output), r.output


# ---------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_greedy_equals_torch_greedy(tmp_path):
    """rollout=vllm: the greedy pass gives the torch sampler's responses (a head size vLLM's CPU
    backend takes: 128 / 4 = 32)."""
    from engine.rollout.vllm_sampler import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(f"vllm cannot be imported here ({reason})")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.evaluate import evaluate
    from tests.tiny_hf import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    d = tmp_path / "m"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    a, b = tmp_path / "t.jsonl", tmp_path / "v.jsonl"
    ra = evaluate(str(d), ["task.num_val=16", f"eval.output={a}", "trainer.device=cpu"])
    rb = evaluate(str(d), ["task.num_val=16", f"eval.output={b}", "rollout=vllm", "trainer.device=cpu"])
    assert rb.sampler == "vllm" and ra.sampler == "torch"
    assert [x["response"] for x in _rows(b)] == [x["response"] for x in _rows(a)]


# ---------------------------------------------------------------------------------------------
# Shell completion
# ---------------------------------------------------------------------------------------------

def test_completion_knows_rl_eval(rl_bin, workdir):
    """`rl ev<TAB>` offers eval; `rl eval <TAB>` offers checkpoints first; `rl eval ckpt/ eval.<TAB>`
    offers eval keys and no key eval would refuse."""
    sub = _run_rl(rl_bin, _bash_protocol("rl ev"), cwd=workdir).stdout.split()
    assert "eval" in sub, sub
    out = _run_rl(rl_bin, {"RL_CACHE_DIR": str(workdir / ".cache"), **_bash_protocol("rl eval ckpt/")},
                  cwd=workdir).stdout.split()
    assert out[:2] == ["ckpt/step_20", "ckpt/step_10"], out
    keys = _run_rl(rl_bin, {"RL_CACHE_DIR": str(workdir / ".cache"), **_bash_protocol("rl eval ckpt/ eval.")},
                   cwd=workdir).stdout.split()
    assert "eval.n=" in keys and "eval.k=" in keys, keys
    top = _run_rl(rl_bin, {"RL_CACHE_DIR": str(workdir / ".cache"), **_bash_protocol("rl eval ckpt/ o")},
                  cwd=workdir).stdout.split()
    assert not [k for k in top if k.startswith("optim")], top
