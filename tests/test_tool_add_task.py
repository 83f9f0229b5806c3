"""The built-in tool task (task=tool_add): every answer is (a + b) mod 7 of its prompt, computed here
from the prompt's text; the calculator computes exactly that and refuses anything that is not two or
more numbers joined by '+' (a lone number once let a policy collect the environment's use bonus
with calls like '1]' whose result told it nothing); a bare ']' asks for the question itself."""

from __future__ import annotations

import re

import pytest

from engine.agents.calculator_env import CalculatorEnvironment
from engine.config.schema import TaskConfig
from engine.tasks.tool_add import calculator, make_tool_add_task


def test_answers_are_the_sum_mod_7_of_the_prompt_and_held_out_prompts_are_not_trained():
    task = make_tool_add_task(TaskConfig(name="tool_add", num_train=200, num_val=50), seed=3)
    for e in task.train + task.val:
        a, b, m = map(int, re.fullmatch(r"(\d{6})\+(\d{6})%(\d+)=", e.prompt).groups())
        assert m == 7 and e.answer == str((a + b) % 7)
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.val}
    assert len({e.answer for e in task.train}) == 7  # every residue occurs


@pytest.mark.parametrize("expr,out", [("123456+654321%7", str((123456 + 654321) % 7)), ("5+3", "8"),
                                      (" 10 + 20 + 30 ", "60"), ("999999+1 % 10", "0")])
def test_calculator_adds_and_reduces(expr, out):
    assert calculator(expr) == out


@pytest.mark.parametrize("expr", ["1", "", "12%7", "1+2%0", "1-2", "1+2]"])
def test_calculator_refuses_what_is_not_a_sum(expr):
    with pytest.raises(ValueError):
        calculator(expr)


def test_a_bare_call_asks_the_question_and_a_junk_call_earns_no_bonus():
    env = CalculatorEnvironment()
    task = make_tool_add_task(TaskConfig(name="tool_add", num_train=1, num_val=1), seed=0)
    row = task.train[0]
    env.reset(row)
    call = env.step([{"role": "assistant", "content": "]"}])
    assert not call.done and call.messages[0]["content"] == row.answer
    answered = env.step([{"role": "assistant", "content": "]"}, *call.messages,
                         {"role": "assistant", "content": row.answer}])
    assert answered.done and answered.reward > 0
    env.reset(row)
    junk = env.step([{"role": "assistant", "content": "1]"}])
    assert junk.messages[0]["content"].startswith("error") and junk.tool_errors == 1
    end = env.step([{"role": "assistant", "content": "1]"}, *junk.messages, {"role": "assistant", "content": "3"}])
    assert end.done and end.reward == 0.0
