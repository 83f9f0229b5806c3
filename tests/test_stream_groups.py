"""trainer.stream_groups (docs/async.md): in sync mode the ranks yield the rollout chunk by chunk
(rollout.micro_batch_size rows, whole prompt groups) and the driver scores each chunk on a thread
as soon as it arrives, while the ranks sample the next. Streaming changes when rewards are
computed, never what is trained: the run must be the unstreamed run exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine.batch import SequenceBatch
from engine.config.load import load_run_config
from engine.config.schema import RolloutConfig
from engine.errors import ConfigError
from engine.rewards.compute import RewardFailure, RewardScores
from engine.rollout.torch_sampler import TorchSampler
from tests.cli_utils import rl_concurrently
from tests.test_rollout_speed import EOS, PAD, model  # noqa: F401 - the tiny model whose rows end at different steps

ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}
TRAINED = ("reward_mean", "accuracy", "pg_loss", "grad_norm", "entropy", "response_len_mean", "adv_std", "algo")

REWARDS = '''
import json, os, threading

def first_char(prompts, completions, answer, trainer_state, **kw):
    """TRL-style batched: 1 when the completion starts with the answer's first letter."""
    scores = [float(bool(c) and c[0] == a[0]) for c, a in zip(completions, answer)]
    with open(os.environ["RL_SCORE_LOG"], "a") as f:
        f.write(json.dumps({"global_step": trainer_state.global_step, "rows": len(completions),
                            "thread": threading.current_thread().name, "answers": list(answer)}) + "\\n")
    return scores
'''


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _load(*overrides: str):
    return load_run_config(list(overrides))


PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11, 3], [2], [5, 5], [7, 3, 9]]


@pytest.mark.parametrize("lanes,chunk", [(1, 0), (2, 0), (3, 12), (1, 8)])
def test_groups_streamed_as_they_end_are_the_batch(model, lanes, chunk):
    """The sampler yields each prompt group once all its samples have ended: a group ending early
    comes out before the rows still decoding, alone and complete, and the pieces put back in row
    order are the unstreamed batch, tensor for tensor (same noise, same steps)."""
    cfg = dataclasses.replace(RolloutConfig(), max_new_tokens=10, decode_lanes=lanes, micro_batch_size=chunk)
    n = 4
    whole = TorchSampler(cfg, PAD, EOS, torch.device("cpu")).generate(model, PROMPTS, n, torch.Generator().manual_seed(1))
    pieces = list(TorchSampler(cfg, PAD, EOS, torch.device("cpu")).generate_pieces(
        model, PROMPTS, n, torch.Generator().manual_seed(1), stream=True))
    assert all(len(b) == n and first % n == 0 for first, b in pieces), [(f, len(b)) for f, b in pieces]
    assert sorted(f for f, _ in pieces) == list(range(0, len(PROMPTS) * n, n))  # every group once
    lens = [int(b.response_lengths.max()) for _, b in pieces]
    assert min(lens) < max(lens) == 10, "groups must end at different steps"
    if chunk == 0:  # one decode: the groups come out in the order they end, the longest last
        assert lens == sorted(lens) or lanes > 1, lens
    joined = SequenceBatch.concat([b for _, b in sorted(pieces, key=lambda p: p[0])], PAD)
    for name in whole.tensor_fields():
        a, b = getattr(whole, name), getattr(joined, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def test_scores_of_chunks_join_into_the_scores_of_the_whole():
    a = RewardScores([1.0, 0.0], {"f": 0.5, "g": 1.0}, [True, False], [], {"f": [1.0, 0.0], "g": [1.0, None]}, [])
    b = RewardScores([0.5, 0.0, 1.0], {"f": None, "g": 0.0}, [False, False, True],
                     [RewardFailure("g", "row 1", "ValueError: x")], {"f": [None, None, None], "g": [0.0, 0.0, 1.0]},
                     [0, 1])
    joined = RewardScores.concat([a, b])
    assert joined.total == [1.0, 0.0, 0.5, 0.0, 1.0]
    assert joined.correct == [True, False, False, False, True]
    assert joined.per_sample_fn == {"f": [1.0, 0.0, None, None, None], "g": [1.0, None, 0.0, 0.0, 1.0]}
    # each function's mean over every sample it scored (its Nones left out), not a mean of chunk means
    assert joined.per_fn == {"f": 0.5, "g": 0.5}
    assert joined.unscored == [2, 3] and len(joined.failures) == 1


@pytest.mark.parametrize("overrides, words", [
    (["trainer.mode=one_step_off"], "trainer.mode=one_step_off"),
    (["rollout=vllm"], "rollout=vllm"),
    (["task=tool_add"], "multi-turn"),
    (["rollout.micro_batch_size=12"], "splits groups of algorithm.rollout_n=8"),
])
def test_where_it_cannot_stream_it_says_why_and_what_to_set(overrides, words):
    with pytest.raises(ConfigError) as e:
        _load("trainer.stream_groups=true", *overrides)
    text = " ".join(str(e.value).split())
    assert "trainer.stream_groups" in text and words in text, text


def test_chunks_of_whole_groups_are_accepted():
    for chunk in ("0", "64"):
        assert _load("trainer.stream_groups=true", f"rollout.micro_batch_size={chunk}").config.trainer.stream_groups


@pytest.mark.slow
def test_streamed_run_is_the_unstreamed_run_with_each_chunk_scored_as_it_arrives(tmp_path):
    """Two ranks, 8 prompts x 4 samples, DAPO's dynamic sampling refilling. The streamed run scores
    each prompt group on its scoring thread as the group ends, with the trainer state of its step,
    and trains exactly what the unstreamed run trains."""
    rows_in = [{"prompt": f"say {w}:", "answer": w} for w in ["hi", "ok", "yes", "no"] * 4]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    (tmp_path / "scorelog.py").write_text(REWARDS)
    job = ["task=dataset", "task.path=train.jsonl", "task.reward_fn=scorelog:first_char", "task.num_val=0",
           "trainer.total_steps=3", "data.train_batch_size=8", "algorithm.rollout_n=4", "rollout.max_new_tokens=4",
           "trainer.nprocs=2", "trainer.threads_per_rank=1",
           "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=1", "checkpoint.save_freq=0",
           "checkpoint.save_final=false"]
    runs = {"plain": tmp_path / "plain", "stream": tmp_path / "stream"}
    pre = ("import os, sys\n"
           "d = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('checkpoint.dir='))\n"
           "os.environ['RL_SCORE_LOG'] = d + '.scores.jsonl'\n")
    results = rl_concurrently(["train", *job, f"checkpoint.dir={runs['plain']}"],
                              ["train", *job, "trainer.stream_groups=true", f"checkpoint.dir={runs['stream']}"],
                              cwd=tmp_path, env=ENV, pre=pre, timeout=900)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plain, stream = _rows(runs["plain"]), _rows(runs["stream"])
    assert len(plain) == len(stream) == 3
    for p, s in zip(plain, stream):
        assert {k: p.get(k) for k in TRAINED} == {k: s.get(k) for k in TRAINED}, (p["step"], p, s)

    calls = {k: [json.loads(x) for x in Path(f"{v}.scores.jsonl").read_text().splitlines()] for k, v in runs.items()}
    # unstreamed: one call per draw, on the main thread; streamed: one per prompt group on the scoring
    # thread, in the order the groups ended, the same samples, each with its step's trainer state
    assert all(c["thread"] == "MainThread" and c["rows"] % 4 == 0 and c["rows"] > 4 for c in calls["plain"])
    assert all(c["thread"].startswith("rl-score-stream") and c["rows"] == 4 for c in calls["stream"]), calls["stream"]
    for step in (0, 1, 2):
        answers = {k: sorted(a for c in v if c["global_step"] == step for a in c["answers"]) for k, v in calls.items()}
        assert answers["plain"] == answers["stream"] and answers["plain"], step
    for s in stream:  # the step waited for the scoring left after the last chunk, never more than all of it
        assert s["timing"]["reward"] <= s["timing"]["reward_ahead"] + 0.05, s["timing"]
