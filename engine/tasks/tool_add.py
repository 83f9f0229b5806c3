"""Built-in task ``tool_add``: adding two 3-digit numbers, with a calculator the model may call.

Prompt ``'123+456='`` -> answer ``'579'``. A tiny model learns to add numbers below 50 from
scratch (task=add), but 3-digit sums with carries are much harder to learn by RL in a CPU run;
the calculator makes the task a copy: the model writes the expression and ``]`` (the built-in
tokenizer's compact tool-call format, engine/agents/parsers.py), the tool's result is appended,
and the model copies it as its final turn.

Scoring (task=add's ``add_reward``) looks at the model's *last turn* only (tool output is never
credited by itself): 1.0 for the exact sum, else 0.5 x the fraction of digits right by
position (partial credit, as task=add). The no-tool twin is the same task with
``rollout.max_turns=1``: a call then ends the trajectory and scores nothing, so the model must
add by itself.
"""

from __future__ import annotations

import random
import re
import string

from engine.config.schema import TaskConfig
from engine.data.example import Example
from engine.tasks.base import Task
from engine.tasks.builtin import add_correct, add_reward  # the same scoring as task=add


def calculator(expr: str) -> str:
    """Adds whole numbers.

    Args:
        expr: whole numbers joined by '+', like 123+456
    """
    numbers = re.findall(r"\d+", expr)
    if not numbers:
        raise ValueError("no number")
    return str(sum(int(x) for x in numbers))


def make_tool_add_task(cfg: TaskConfig, seed: int) -> Task:
    rng = random.Random(seed)

    def sample() -> Example:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    val = [sample() for _ in range(cfg.num_val)]
    held = {e.prompt for e in val}
    train = []
    while len(train) < cfg.num_train:
        e = sample()
        if e.prompt not in held:
            train.append(e)
    return Task("tool_add", train, val, add_reward, correct=add_correct,
                alphabet=string.digits + "+=]", tools=[calculator],
                environment="engine.agents.calculator_env:CalculatorEnvironment")
