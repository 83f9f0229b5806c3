"""Reward functions in every convention: per sample with the row's columns by name, batched
(TRL), several with weights, in a spawned process pool; failures (raise, hang, bad value) end
as configured; built-in verifiable rewards."""

from __future__ import annotations


import json

import pytest

from engine.config.schema import TaskConfig
from engine.errors import ConfigError
from engine.rewards import builtin
from engine.rewards.compute import RewardError, RewardRunner, samples_of
from engine.rewards.spec import RewardFnSpec, user_reward_specs
from engine.tasks.dataset import make_dataset_task
from tests.data_fixtures import write_trl_jsonl, write_verl_parquet

USER_REWARDS = '''
import time

def verl_score(prompt, response, answer, data_source, reward_model, extra_info, ground_truth):
    # verl's compute_score gets data_source, the ground truth and extra_info
    assert data_source == "openai/gsm8k" and reward_model["ground_truth"] == ground_truth == answer
    return (float(response.strip() == answer) + extra_info["index"] / 100, response.strip() == answer)

def trl_batched(prompts, completions, solution, difficulty, **kwargs):
    # TRL: conversational completions are [{"role": "assistant", "content": ...}]
    return [float(c[0]["content"].strip() == s) + d / 10 for c, s, d in zip(completions, solution, difficulty)]

def trl_per_sample(prompt, response, answer, solution, difficulty):
    return float(response.strip() == solution) + difficulty / 10

def length(prompt, response, answer, **row):
    return len(response) / 10

def slow(prompt, response, answer, **row):
    time.sleep(0.05)
    return len(response) / 10

def raises(prompt, response, answer, **row):
    if "boom" in response:
        raise ZeroDivisionError("division by zero")
    return 1.0

def hangs(prompt, response, answer, **row):
    if "hang" in response:
        time.sleep(600)
    return 1.0

def alarmed(prompt, response, answer):
    # a signal.alarm timeout, as some graders use: Python allows it only on a process's main thread
    import signal
    old = signal.signal(signal.SIGALRM, lambda *a: None)
    signal.alarm(5)
    try:
        return 1.0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)

def not_a_number(prompt, response, answer):
    return "high"

def wrong_length(prompts, completions, **kw):
    return [1.0]

def needs_missing(prompt, response, answer, rubric):
    return 1.0

def is_exact(prompt, response, answer, **row):
    return response.strip() == str(answer)

def logs_then_hangs(prompt, response, answer):
    # records (response, worker pid, start time) when it starts; scores its pid
    import os
    with open("starts.log", "a") as f:
        f.write(f"{response}:{os.getpid()}:{time.time()}\\n")
    time.sleep({"hang": 600, "slow": 3.5, "pre": 2.5}.get(response.split("-")[0], 0.1))
    return float(os.getpid())
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return "user_rewards"


def runner(specs, **kw) -> RewardRunner:
    return RewardRunner(specs, **kw)


def spec(name, weight=1.0, batched=False, role="reward"):
    return RewardFnSpec(name, name, weight, batched, role)


def test_verl_columns_reach_the_reward_by_name(tmp_path, mod):
    """Every verl column (nested reward_model, data_source, extra_info, ground_truth) arrives by
    name; a (score, correct) return gives accuracy."""
    task = make_dataset_task(TaskConfig(name="dataset", path=str(write_verl_parquet(tmp_path / "t.parquet", 6)),
                                        reward_fn=f"{mod}:verl_score", num_val=0), seed=0)
    responses = [e.answer if i % 2 else "nope" for i, e in enumerate(task.train)]
    r = runner(task.reward_specs).score(samples_of(task.train, responses))
    idx = [e.row["extra_info"]["index"] for e in task.train]
    assert r.total == pytest.approx([float(i % 2) + idx[i] / 100 for i in range(6)])
    assert r.correct == [bool(i % 2) for i in range(6)]


def test_batched_and_parallel_equal_serial(tmp_path, mod):
    """TRL batched fn == the same rule per sample == in a 2-process pool; weights sum; each
    function's mean reported separately."""
    task = make_dataset_task(TaskConfig(name="dataset", path=str(write_trl_jsonl(tmp_path / "c.jsonl", 8)),
                                        reward_fn=f"{mod}:trl_batched", reward_batched=True, num_val=0), seed=0)
    responses = [e.row["solution"] if i % 3 else "x" for i, e in enumerate(task.train)] * 2
    samples = samples_of(task.train + task.train, responses)
    batched = runner(task.reward_specs).score(samples)
    per_sample = runner([spec(f"{mod}:trl_per_sample")]).score(samples)
    assert batched.total == pytest.approx(per_sample.total)
    both = [spec(f"{mod}:trl_per_sample", 1.0), spec(f"{mod}:length", 0.5)]
    serial = runner(both).score(samples)
    pool = runner(both, workers=2, timeout_s=60)
    pool_batched = runner([spec(f"{mod}:trl_batched", batched=True)], workers=2)
    try:
        parallel = pool.score(samples)
        assert pool.score(samples).total == parallel.total  # the pool is kept between steps
        parallel_batched = pool_batched.score(samples)
    finally:
        pool.close()
        pool_batched.close()
    assert parallel.total == pytest.approx(serial.total)
    assert parallel_batched.total == pytest.approx(batched.total)
    assert serial.total == pytest.approx([a + 0.5 * len(r) / 10 for a, r in zip(per_sample.total, responses)])
    assert set(serial.per_fn) == {f"{mod}:trl_per_sample", f"{mod}:length"}
    assert serial.per_fn[f"{mod}:length"] == pytest.approx(sum(len(r) / 10 for r in responses) / len(responses))


SAMPLES = samples_of([type("E", (), {"prompt": "p", "answer": "a", "row": {}, "origin": f"t.jsonl row {i}"})()
                      for i in range(4)], ["ok", "boom", "ok", "hang"])


@pytest.mark.parametrize("workers", [0, 2])
def test_raising_reward_names_function_row_and_exception(mod, workers):
    r = runner([spec(f"{mod}:raises")], workers=workers)
    try:
        with pytest.raises(RewardError) as e:
            r.score(SAMPLES)
    finally:
        r.close()
    msg = e.value.message
    assert f"`{mod}:raises` failed on t.jsonl row 1" in msg and "ZeroDivisionError: division by zero" in msg
    assert "user_rewards.py:" in msg and "in raises" in msg and "task.reward_on_error=zero" in msg


def test_a_signal_timeout_off_the_main_thread_gets_the_fix_not_call_it_on_that_row(mod):
    """A function that sets a signal handler works on the main thread and in the process pool, but
    fails on the threads rl scores from (one_step_off's scoring thread; task.reward_timeout_s's
    watched thread), where calling it on the row in a script would not reproduce the failure: the
    error names the thread and why rl uses it, and the fix (the pool, or no signals)."""
    from concurrent.futures import ThreadPoolExecutor

    fn = [spec(f"{mod}:alarmed")]
    assert runner(fn).score(SAMPLES).total == [1.0] * 4  # main thread
    pool = runner(fn, workers=1, timeout_s=30)
    try:
        assert pool.score(SAMPLES).total == [1.0] * 4  # a worker process's main thread, timed out by the pool
    finally:
        pool.close()
    with ThreadPoolExecutor(1, thread_name_prefix="rl-score-ahead") as t:
        with pytest.raises(RewardError) as e:
            t.submit(runner(fn).score, SAMPLES).result()
    msg = e.value.message
    assert "signal only works in main thread" in msg and "driver thread `rl-score-ahead_0`" in msg, msg
    assert "trainer.mode=one_step_off|async" in msg and "task.reward_workers=N" in msg, msg
    assert "call it on that row to reproduce" not in msg, msg
    with pytest.raises(RewardError, match=r"on a thread that times it out \(task.reward_timeout_s\)\. Set "
                                          r"task.reward_workers=N"):
        runner(fn, timeout_s=30).score(SAMPLES)
    with pytest.raises(RewardError, match="call it on that row to reproduce"):  # any other failure: as before
        runner([spec(f"{mod}:raises")], timeout_s=30).score(SAMPLES)


@pytest.mark.parametrize("workers", [0, 2])
def test_hanging_reward_times_out(mod, workers):
    """A hung call: an error naming the function and the row (raise); or scored 0 and counted
    (zero), the other rows still scored. In the pool the hung process is killed."""
    r = runner([spec(f"{mod}:hangs")], workers=workers, timeout_s=2)
    try:
        with pytest.raises(RewardError, match=rf"`{mod}:hangs` failed on t.jsonl row 3.*reward_timeout_s=2"):
            r.score(SAMPLES)
    finally:
        r.close()
    z = runner([spec(f"{mod}:hangs"), spec(f"{mod}:raises")], workers=workers, timeout_s=2, on_error="zero")
    try:
        out = z.score(SAMPLES)
        again = z.score(SAMPLES[:3])  # the pool (or thread) recovers for the next step
    finally:
        z.close()
    assert out.total == [2.0, 1.0, 2.0, 1.0]
    assert sorted((f.fn.split(":")[1], f.origin) for f in out.failures) == [("hangs", "t.jsonl row 3"),
                                                                          ("raises", "t.jsonl row 1")]
    assert again.total == [2.0, 1.0, 2.0] and len(again.failures) == 1


def test_bad_return_values(mod):
    with pytest.raises(RewardError, match=r"not_a_number` failed on t.jsonl row 0 \(prompt 'p'\): bad return value: returned "
                                          r"str 'high'"):
        runner([spec(f"{mod}:not_a_number")]).score(SAMPLES)
    with pytest.raises(RewardError, match=r"returned 1 value\(s\) for a batch of 4"):
        runner([spec(f"{mod}:wrong_length", batched=True)]).score(SAMPLES)


def test_correct_fn_gives_accuracy(mod):
    r = runner([spec(f"{mod}:length"), spec(f"{mod}:is_exact", role="correct")])
    out = r.score(samples_of([type("E", (), {"prompt": "p", "answer": "ok", "row": {}, "origin": "r"})()] * 2,
                             ["ok", "no"]))
    assert out.correct == [True, False] and out.total == pytest.approx([0.2, 0.2])


def test_config_errors(mod):
    with pytest.raises(ConfigError, match=r"2 value\(s\) for 1 reward function"):
        user_reward_specs(TaskConfig(name="dataset", reward_fns=[f"{mod}:length"], reward_weights=[1, 2]))
    # a TRL-shaped function (prompts, completions, ...) is batched by its signature, flag or not (issue 42)
    assert user_reward_specs(TaskConfig(name="dataset", reward_fn=f"{mod}:trl_batched"))[0].batched
    with pytest.raises(ConfigError, match=r"looks per-sample.*drop task.reward_batched=true"):
        user_reward_specs(TaskConfig(name="dataset", reward_fn=f"{mod}:length", reward_batched=True))
    with pytest.raises(ConfigError, match=r"no built-in reward `math_boxd`\. Did you mean `rl:math_boxed`"):
        user_reward_specs(TaskConfig(name="dataset", reward_fn="rl:math_boxd"))
    with pytest.raises(ConfigError, match=r"no function `nope`"):
        user_reward_specs(TaskConfig(name="dataset", reward_fn=f"{mod}:nope"))


def test_parameter_no_column_provides_is_refused_at_load(tmp_path, mod):
    path = write_trl_jsonl(tmp_path / "c.jsonl", 4)
    with pytest.raises(ConfigError, match=r"needs rubric, which the dataset does not have \(columns: difficulty, "
                                          r"solution\)"):
        make_dataset_task(TaskConfig(name="dataset", path=str(path), reward_fn=f"{mod}:needs_missing"), seed=0)


def test_builtin_verifiable_rewards():
    assert builtin.math_boxed("", r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}") == (1.0, True)
    assert builtin.math_boxed("", r"\boxed{3} then \boxed{4}", "4") == (1.0, True)
    assert builtin.math_boxed("", "4", "4") == (0.0, False)  # no boxed answer
    assert builtin.math_boxed("", r"\boxed{1,000}", "1000") == (1.0, True)
    assert builtin.gsm8k("", "She sold 48 + 24 = 72 clips.\n#### 72", "72") == (1.0, True)
    assert builtin.gsm8k("", "... #### 72.0", "Natalia ... #### 72") == (1.0, True)
    assert builtin.gsm8k("", "the answer is 71", "72") == (0.0, False)
    assert builtin.exact_match("", " yes\n", "yes") == (1.0, True)
    assert builtin.boxed_format("", r"\boxed{x}", "") == 1.0 and builtin.boxed_format("", "x", "") == 0.0
    assert builtin.think_format("", "<think>hm</think> 4", "") == 1.0
    assert builtin.think_format("", "<think>hm</think>", "") == 0.0


def test_builtin_rewards_by_name(tmp_path, mod):
    specs = user_reward_specs(TaskConfig(name="dataset", reward_fns=["rl:gsm8k", "rl:boxed_format"],
                                         reward_weights=[1.0, 0.2]))
    out = runner(specs).score(samples_of([type("E", (), {"prompt": "p", "answer": "72", "row": {}, "origin": "r"})()],
                                         [r"\boxed{72}"]))
    assert out.total == [pytest.approx(1.2)] and out.correct == [True]


def test_slow_reward_scores_the_same_in_the_pool(mod):
    """Throughput is measured in bench/rewards.py; here only that a slow reward gives the same
    scores in the pool."""
    s = SAMPLES[:2]
    pool = runner([spec(f"{mod}:slow")], workers=2)
    try:
        assert pool.score(s).total == runner([spec(f"{mod}:slow")]).score(s).total
    finally:
        pool.close()


def test_closing_the_pool_never_waits_on_a_hung_call(mod, tmp_path):
    """A run that stops while a reward call hangs (no timeout set): close() kills the worker
    instead of waiting for it, and the scorer waiting on that call is told, not left hanging."""
    import threading

    r = runner([spec(f"{mod}:logs_then_hangs")], workers=1)
    errors = []

    def score():
        try:
            r.score(samples_of([_row(0)], ["hang"]))  # hangs: no timeout
        except RewardError as e:
            errors.append(e.message)

    t = threading.Thread(target=score, daemon=True)
    t.start()
    pid = _started(tmp_path, "hang")
    r._pool.close(grace_s=1)
    assert not _alive(pid)
    t.join(timeout=30)
    assert errors and "the reward worker process died" in errors[0]


def test_a_hung_call_kills_only_its_own_worker(mod, tmp_path):
    """Part 8 of issue 42: a call past task.reward_timeout_s has its worker killed and replaced;
    the calls in flight in the other workers when it is killed finish where they started (each
    started once, its result from the same process, which is still alive), and the pool serves
    the next step. Before (concurrent.futures), one hang killed every worker and resent the calls
    in flight."""
    timeout = 5.0  # slow-* run 2.5-6 s after hang starts: across its kill at 5 s, within their own 5 s
    r = runner([spec(f"{mod}:logs_then_hangs")], workers=3, timeout_s=timeout, on_error="zero")
    try:
        r.score(samples_of([_row(i) for i in range(6)], ["warm"] * 6))  # every worker started
        (tmp_path / "starts.log").unlink()
        calls = ["hang", "pre-a", "pre-b", "slow-a", "slow-b"]  # slow-* start after pre-*, 2.5 s after hang
        out = r.score(samples_of([_row(i) for i in range(5)], calls))
        starts = _starts(tmp_path)
        assert sorted(w for w, _, _ in starts) == sorted(calls)  # none resent
        pid = {w: p for w, p, _ in starts}
        t = {w: s for w, _, s in starts}
        for w in ("slow-a", "slow-b"):  # running when the hung call was killed (3.5 s from its start)
            assert t["hang"] + timeout - 3.5 < t[w] < t["hang"] + timeout, (t, w)
        assert out.total == [0.0] + [float(pid[w]) for w in calls[1:]]  # each finished where it started
        assert [f.origin for f in out.failures] == ["t.jsonl row 0"]
        assert "reward_timeout_s=5" in out.failures[0].error
        assert not _alive(pid["hang"]) and all(_alive(pid[w]) for w in calls[1:])
        again = r.score(samples_of([_row(i) for i in range(3)], ["next"] * 3))
        assert not again.failures and all(v > 0 for v in again.total)
    finally:
        r.close()


def test_pool_without_pebble_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pebble", None)
    with pytest.raises(ConfigError, match=r"needs pebble.*pip install 'rl\[rewards\]'.*reward_workers=0"):
        runner([spec("rl:exact_match")], workers=2)


def _row(i):
    return type("E", (), {"prompt": "p", "answer": "a", "row": {}, "origin": f"t.jsonl row {i}"})()


def _starts(tmp_path) -> list[tuple[str, int, float]]:
    """(response, worker pid, start time) of every call logs_then_hangs started."""
    path = tmp_path / "starts.log"
    lines = path.read_text().split() if path.exists() else []
    return [(w, int(pid), float(t)) for w, pid, t in (line.split(":") for line in lines)]


def _started(tmp_path, what: str, timeout_s: float = 60) -> int:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = {w: p for w, p, _ in _starts(tmp_path)}
        if what in pids:
            return pids[what]
        time.sleep(0.05)
    raise AssertionError(f"{what} never started")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# The anchors' own documented reward functions, written out verbatim (issue 42):
# - TRL, GRPOTrainer docs, "Using a custom reward function", Example 1 "Reward longer completions"
#   (standard format) and Example 2 "Reward completions with specific format" (conversational):
#   https://huggingface.co/docs/trl/main/en/grpo_trainer#using-a-custom-reward-function
# - verl, "Implement Reward Function for Dataset", customized reward function:
#   https://verl.readthedocs.io/en/latest/preparation/reward_function.html
ANCHOR_REWARDS = '''
import re


def reward_func(completions, **kwargs):
    """Reward function that gives higher scores to longer completions."""
    return [float(len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
  return len(solution_str)/100


def verl_dict_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth,
            "pred": solution_str}


async def async_len(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]
'''


@pytest.fixture
def anchors(tmp_path, monkeypatch):
    (tmp_path / "anchor_rewards.py").write_text(ANCHOR_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return "anchor_rewards"


@pytest.mark.parametrize("batched_flag", [False, True])
def test_trl_documented_reward_functions_run_unchanged(tmp_path, anchors, batched_flag):
    """TRL's documented `def f(completions, **kwargs)` functions are called as TRL calls them (by
    keyword, whole batches), whether or not task.reward_batched is set: their signature says so.
    Before: exit 2 advising to drop reward_batched (with it) or a per-sample call (without)."""
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) + "\n" for i in range(4)))
    task = make_dataset_task(TaskConfig(name="dataset", path=str(text), reward_fn=f"{anchors}:reward_func",
                                        reward_batched=batched_flag, num_val=0), seed=0)
    responses = ["x" * (i + 1) for i in range(4)]
    assert runner(task.reward_specs).score(samples_of(task.train, responses)).total == [1.0, 2.0, 3.0, 4.0]
    chat = make_dataset_task(TaskConfig(name="dataset", path=str(write_trl_jsonl(tmp_path / "c.jsonl", 4)),
                                        reward_fn=f"{anchors}:format_reward_func", reward_batched=batched_flag,
                                        num_val=0), seed=0)
    responses = ["<think>hm</think><answer>4</answer>", "4", "<think></think><answer>x</answer>", "<answer>4</answer>"]
    assert runner(chat.reward_specs).score(samples_of(chat.train, responses)).total == [1.0, 0.0, 1.0, 0.0]
    asyncs = make_dataset_task(TaskConfig(name="dataset", path=str(text), reward_fn=f"{anchors}:async_len",
                                          num_val=0), seed=0)
    assert runner(asyncs.reward_specs).score(samples_of(asyncs.train, ["ab", "c", "", "dddd"])).total == \
        [2.0, 1.0, 0.0, 4.0]


def test_verl_documented_compute_score_runs_unchanged(tmp_path, anchors):
    """verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None)` is called by
    keyword with the row's data_source, the response, reward_model.ground_truth and extra_info, and
    a dict return gives its `score` (and `acc` as correctness). Before: preflight ok, then a
    TypeError at step 1 ("got multiple values for argument 'data_source'")."""
    data = write_verl_parquet(tmp_path / "v.parquet", 4)
    task = make_dataset_task(TaskConfig(name="dataset", path=str(data), reward_fn=f"{anchors}:my_reward_fn",
                                        num_val=0), seed=0)
    responses = ["x" * 10, "x" * 20, "", "x" * 5]
    assert runner(task.reward_specs).score(samples_of(task.train, responses)).total == \
        pytest.approx([0.1, 0.2, 0.0, 0.05])
    task = make_dataset_task(TaskConfig(name="dataset", path=str(data), reward_fn=f"{anchors}:verl_dict_score",
                                        num_val=0), seed=0)
    responses = [e.answer if i % 2 else "wrong" for i, e in enumerate(task.train)]
    r = runner(task.reward_specs).score(samples_of(task.train, responses))
    assert r.total == [0.0, 1.0, 0.0, 1.0] and r.correct == [False, True, False, True]


# (response's boxed answer, reference): equal as mathematics, written differently
EQUIVALENT = [(r"\frac{1}{2}", "0.5"), (r"2\sqrt{2}", r"\sqrt{8}"), ("1/2", r"\frac{1}{2}"), ("0.50", "1/2"),
              (r"\frac{6}{4}", r"\frac{3}{2}"), (r"\dfrac{1}{3}", r"\frac{1}{3}"), ("3.0", "3"),
              (r"x^2+2x+1", r"(x+1)^2")]
DIFFERENT = [("0.51", "1/2"), (r"\sqrt{2}", r"\sqrt{8}"), ("2", "3"), (r"x^2+1", r"(x+1)^2")]


def test_math_answers_are_compared_as_mathematics():
    """rl:math_boxed compared normalised strings and numbers: 2 of these 8 equal answers were right
    (issue 42). With math-verify (the `data` extra), rl:math_boxed and rl:math_verify score all 8
    right and the 4 different ones wrong; rl:math_verify also reads an unboxed final answer."""
    pytest.importorskip("math_verify")
    assert sum(builtin.same_answer(p, a) for p, a in EQUIVALENT) == 2  # the string rule alone
    for p, a in EQUIVALENT:
        assert builtin.math_boxed("", rf"so \boxed{{{p}}}.", a) == (1.0, True), (p, a)
        assert builtin.math_verify("", rf"so \boxed{{{p}}}.", a) == (1.0, True), (p, a)
    for p, a in DIFFERENT:
        assert builtin.math_boxed("", rf"\boxed{{{p}}}", a) == (0.0, False), (p, a)
        assert builtin.math_verify("", rf"\boxed{{{p}}}", a) == (0.0, False), (p, a)
    assert builtin.math_verify("", "The answer is $\\frac{3}{6}$", "0.5") == (1.0, True)
    assert builtin.math_boxed("", "0.5", "0.5") == (0.0, False)  # math_boxed still asks for a boxed answer
