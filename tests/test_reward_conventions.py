"""TRL's and verl's reward functions run unchanged (issue 42, part 1), checked with the anchors'
own documented examples, written out verbatim below (TRL is not imported: it is only a bench
baseline). TRL calls a reward function by keyword with prompts=, completions=, completion_ids=,
trainer_state= and every dataset column; a None means "does not apply" (left out of that
function's mean, nothing added to the sum, a warning when every function gave None for a
sample). verl calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=)."""

from __future__ import annotations

import json
import warnings

import pytest

from engine.config.schema import TaskConfig
from engine.rewards.call import Sample
from engine.rewards.compute import RewardRunner, samples_of
from engine.rewards.spec import user_reward_specs
from engine.rewards.trainer_state import TrainerState
from engine.tasks.dataset import make_dataset_task

# TRL, GRPOTrainer docs, "Using a custom reward function", Examples 1, 1.1, 2, 3, 4, 5 and 6:
# https://huggingface.co/docs/trl/main/en/grpo_trainer#using-a-custom-reward-function
# (huggingface/trl docs/source/grpo_trainer.md at f2cd577). Each is a module of its own, as the
# docs reuse the name `reward_func`. check_math_solution / test_code_solution are left to the
# reader there; they are defined here.
TRL_EXAMPLE_1 = '''
def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]
'''

TRL_EXAMPLE_1_1 = '''
def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]
'''

TRL_EXAMPLE_2 = '''
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]
'''

TRL_EXAMPLE_3 = r'''
import re

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
'''

TRL_EXAMPLE_4 = '''
def check_math_solution(prompt, completion):  # not in the docs: the reader's own check
    return {"What is 2+2?": "4", "What is 3*4?": "12"}[prompt] in completion

def test_code_solution(prompt, completion):  # not in the docs: the reader's own check
    return "def " in completion

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards
'''

TRL_EXAMPLE_5 = '''
import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]
'''

TRL_EXAMPLE_6 = r'''
import re

def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards
'''

# trainer_state: the docs (same section, "Input arguments") say it "can be used to implement
# dynamic reward functions, such as curriculum learning, where the reward is adjusted based on
# the training progress"; these use the TrainerState fields such functions read.
TRAINER_STATE = '''
def curriculum(completions, trainer_state, **kwargs):
    weight = trainer_state.global_step / trainer_state.max_steps
    return [weight * len(c) for c in completions]

def sees_everything(prompts, completions, completion_ids, trainer_state, **kwargs):
    return [float(len(ids) * 100 + trainer_state.global_step + 10 * trainer_state.epoch) for ids in completion_ids]

def per_sample_progress(prompt, response, answer, trainer_state, completion_ids):
    return trainer_state.global_step + len(completion_ids) / 10

def per_sample_row(prompt, response, answer, **row):
    assert "trainer_state" not in row and "completion_ids" not in row, row  # a row is the dataset's columns
    return 1.0
'''

# verl: the built-in GSM8K scorer, verl/utils/reward_score/gsm8k.py (volcengine/verl at b178a3c),
# the "GSM8k example" of https://verl.readthedocs.io/en/latest/preparation/reward_function.html,
# verbatim but for its licence header.
VERL_GSM8K = '''
import re

_SOLUTION_CLIP_CHARS = 300


def extract_solution(solution_str, method="strict"):
    assert method in ["strict", "flexible"]

    # Optimization: Regular expression matching on very long strings can be slow.
    # For math problems, the final answer is usually at the end.
    # We only match on the last 300 characters, which is a safe approximation for 300 tokens.
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]

    if method == "strict":
        # this also tests the formatting of the model
        solutions = re.findall("#### (\\\\-?[0-9\\\\.\\\\,]+)", solution_str)
        if len(solutions) == 0:
            final_answer = None
        else:
            # take the last solution
            final_answer = solutions[-1].replace(",", "").replace("$", "")
    elif method == "flexible":
        answer = re.findall("(\\\\-?[0-9\\\\.\\\\,]+)", solution_str)
        final_answer = None
        if len(answer) == 0:
            # no reward is there is no answer
            pass
        else:
            invalid_str = ["", "."]
            # find the last number that is not '.'
            for final_answer in reversed(answer):
                if final_answer not in invalid_str:
                    break
    return final_answer


def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """The scoring function for GSM8k.

    Reference: Trung, Luong, et al. "Reft: Reasoning with reinforced fine-tuning." Proceedings of the 62nd Annual
    Meeting of the Association for Computational Linguistics (Volume 1: Long Papers). 2024.

    Args:
        solution_str: the solution text
        ground_truth: the ground truth
        method: the method to extract the solution, choices are 'strict' and 'flexible'
        format_score: the score for the format
        score: the score for the correct answer
    """
    answer = extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return 0
    else:
        if answer == ground_truth:
            return score
        else:
            return format_score
'''

MODULES = {"trl_ex1": TRL_EXAMPLE_1, "trl_ex1_1": TRL_EXAMPLE_1_1, "trl_ex2": TRL_EXAMPLE_2, "trl_ex3": TRL_EXAMPLE_3,
           "trl_ex4": TRL_EXAMPLE_4, "trl_ex5": TRL_EXAMPLE_5, "trl_ex6": TRL_EXAMPLE_6, "progress": TRAINER_STATE,
           "verl_gsm8k": VERL_GSM8K}


@pytest.fixture
def mods(tmp_path, monkeypatch):
    for name, text in MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)


def runner(target, workers=0):
    """The runner `task.reward_fn=TARGET` gives (the convention detected from the signature)."""
    return RewardRunner(user_reward_specs(TaskConfig(name="dataset", reward_fn=target)), workers=workers)


def several(*targets):
    return RewardRunner(user_reward_specs(TaskConfig(name="dataset", reward_fns=list(targets))))


def doc_samples(prompts, completions, completion_ids=None, **columns):
    """Samples holding what the docs' tests pass: a message completion is the docs' content."""
    ids = completion_ids or [None] * len(prompts)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(Sample(p, text, "", {k: v[i] for k, v in columns.items()}, f"row {i}", ids[i]))
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_example_1_completion_ids(mods, workers):
    """Example 1 reads completion_ids: [2.0, 4.0] on the docs' own inputs, on the driver and in
    a worker process (the ids travel with the sample). Before: it was given no completion_ids."""
    prompts = ["The sky is", "The sun is"]  # not used in the reward function, but the trainer will pass it
    completions = [" blue.", " in the sky."]  # not used in the reward function, but the trainer will pass it
    completion_ids = [[6303, 13], [304, 279, 12884, 13]]
    r = runner("trl_ex1:reward_func", workers)
    try:
        assert r.score(doc_samples(prompts, completions, completion_ids)).total == [2.0, 4.0]
    finally:
        r.close()


def test_trl_examples_1_1_2_3_5_6_give_the_docs_results(mods):
    prompts = ["The sky is", "The sun is"]
    assert runner("trl_ex1_1:reward_func").score(doc_samples(prompts, [" blue.", " in the sky."])).total == \
        [6.0, 12.0]
    prompts = [
        [{"role": "assistant", "content": "What is the result of (1 + 2) * 4?"}],
        [{"role": "assistant", "content": "What is the result of (3 + 1) * 2?"}],
    ]
    completions = [
        [{"role": "assistant", "content": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12</answer>"}],  # noqa: E501
        [{"role": "assistant", "content": "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."}],  # noqa: E501
    ]
    assert runner("trl_ex2:format_reward_func").score(doc_samples(prompts, completions)).total == [1.0, 0.0]
    prompts = ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."]
    completions = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
    ground_truth = ["2", "5"]
    for target in ("trl_ex3:reward_func", "trl_ex6:reward_func"):  # a dataset column by name; 6: log_* unset
        assert runner(target).score(doc_samples(prompts, completions, ground_truth=ground_truth)).total == [1.0, 0.0]
    assert runner("trl_ex5:async_reward_func").score(doc_samples(["a", "b"], ["yes", ""])).total == [1.0, 0.0]


def test_trl_example_4_none_means_does_not_apply(mods, tmp_path):
    """Example 4's dataset and functions, verbatim: a None is left out of that function's mean
    and adds nothing to the sum (TRL's nanmean/nansum). The docs' dataset says task "code" where
    coding_reward_func asks for "coding", so both functions return None for the code rows: rl,
    like TRL, warns that every function returned None for them. Before: a None scored 0 in the
    function's mean, silently."""
    rows = [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_dataset_task(TaskConfig(name="dataset", path="mixed.jsonl", num_val=0,
                                        reward_fns=["trl_ex4:math_reward_func", "trl_ex4:coding_reward_func"]),
                             seed=0)
    by_prompt = {e.prompt: e for e in task.train}
    examples = [by_prompt[r["prompt"]] for r in rows]
    r = RewardRunner(task.reward_specs)
    with pytest.warns(UserWarning, match=r"every reward function returned None for 2 of 4 samples, e\.g\. "
                                         r"mixed\.jsonl row 1 .*they score 0"):
        out = r.score(samples_of(examples, ["4", "def add(a, b): ...", "13", "def mul(a, b): ..."]))
    assert out.total == [1.0, 0.0, -1.0, 0.0]
    assert out.per_sample_fn["trl_ex4:math_reward_func"] == [1.0, None, -1.0, None]
    assert out.per_fn == {"trl_ex4:math_reward_func": 0.0, "trl_ex4:coding_reward_func": None}
    assert out.unscored == [1, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once a run, not at every step
        r.score(samples_of(examples, ["4"] * 4))


def test_none_for_some_rows_only_is_not_warned(mods):
    """A row one function skips but another scores is scored: no warning; the per-function means
    cover only the rows each function scored."""
    r = several("trl_ex4:math_reward_func", "trl_ex1_1:reward_func")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = r.score(doc_samples(["What is 2+2?", "x"], ["4", "abc"], task=["math", "code"]))
    assert out.total == [2.0, 3.0] and out.unscored == []
    assert out.per_fn == {"trl_ex4:math_reward_func": 1.0, "trl_ex1_1:reward_func": 2.0}


def test_trainer_state_reaches_functions_that_ask_for_it(mods):
    """trainer_state= carries global_step/max_steps/epoch (engine/rewards/trainer_state.py); the
    last state given stays for the next call; a per-sample function gets it and its own
    completion_ids when it names them, and a `**row` function's row stays the dataset's."""
    samples = doc_samples(["p", "q"], ["ab", "abcd"], [[1, 2], [3, 4, 5]])
    r = runner("progress:curriculum")
    assert r.score(samples, TrainerState(global_step=0, max_steps=4)).total == [0.0, 0.0]
    assert r.score(samples, TrainerState(global_step=2, max_steps=4)).total == [1.0, 2.0]
    assert r.score(samples).total == [1.0, 2.0]  # the last state given
    state = TrainerState(global_step=3, max_steps=10, epoch=0.5)
    assert runner("progress:sees_everything", workers=1).score(samples, state).total == [208.0, 308.0]
    assert runner("progress:per_sample_progress").score(samples, state).total == [3.2, 3.3]
    assert runner("progress:per_sample_row").score(samples, state).total == [1.0, 1.0]
    assert TrainerState(global_step=3, max_steps=12).progress == 0.25


def test_verl_builtin_gsm8k_compute_score_runs_unchanged(mods, tmp_path):
    """verl's own GSM8K compute_score(solution_str, ground_truth, method=..., ...) names
    solution_str: called by keyword with the response and reward_model.ground_truth of verl's
    Parquet; its defaults (strict, score 1, format_score 0) apply."""
    from tests.data_fixtures import write_verl_parquet

    task = make_dataset_task(TaskConfig(name="dataset", path=str(write_verl_parquet(tmp_path / "g.parquet", 4)),
                                        reward_fn="verl_gsm8k:compute_score", num_val=0), seed=0)
    responses = [f"so 3 + 4 = 7.\n#### {e.answer}" if i % 2 else f"the answer is {e.answer}"
                 for i, e in enumerate(task.train)]
    assert RewardRunner(task.reward_specs).score(samples_of(task.train, responses)).total == [0.0, 1.0, 0.0, 1.0]


RECORDING = '''
import json

def record(completions, completion_ids, trainer_state, **kwargs):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"state": vars(trainer_state), "ids": completion_ids, "texts": completions}) + "\\n")
    return [float(len(ids)) for ids in completion_ids]
'''


@pytest.mark.slow
def test_rl_train_passes_completion_ids_and_trainer_state(tmp_path):
    """Through `rl train`: a TRL function asking for completion_ids and trainer_state gets each
    response's sampled token ids (its reward, len(ids), is the logged reward) and where training
    is: global_step = steps completed (0, 1), max_steps = trainer.total_steps, epoch = prompts
    drawn / prompts; the validations before step 1 and after step 2 see global_step 0 and 2."""
    from tests.cli_utils import rl

    rows = [{"prompt": f"say {w}:", "answer": w} for w in ["hi", "ok", "yes", "no"] * 5]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "recording.py").write_text(RECORDING)
    r = rl("train", "task=dataset", "task.path=train.jsonl", "task.reward_fn=recording:record", "task.num_val=4",
           "trainer.total_steps=2", "trainer.val_freq=2", "data.train_batch_size=4", "algorithm.rollout_n=2",
           "rollout.max_new_tokens=4", "checkpoint.dir=ck", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    calls = [json.loads(x) for x in (tmp_path / "seen.jsonl").read_text().splitlines()]
    val, train = [calls[0], calls[3]], calls[1:3]  # validation before step 1 and after step 2
    assert [c["state"]["global_step"] for c in train] == [0, 1] and [c["state"]["global_step"] for c in val] == [0, 2]
    assert all(c["state"]["max_steps"] == 2 and c["state"]["num_train_epochs"] == 2 * 4 / 16 for c in calls)
    assert [c["state"]["epoch"] for c in calls] == [0, 4 / 16, 8 / 16, 8 / 16]  # 16 training prompts, 4 a step
    assert [len(c["ids"]) for c in calls] == [4, 8, 8, 4]
    assert all(1 <= len(ids) <= 4 and all(isinstance(t, int) for t in ids) for c in calls for ids in c["ids"])
    metrics = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_mean"] for m in metrics] == pytest.approx([sum(map(len, c["ids"])) / 8 for c in train])
