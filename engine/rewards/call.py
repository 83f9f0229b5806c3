"""How one reward call is made and what it may return. Imported by spawned reward workers:
keep it free of torch and of the trainer.

Conventions (docs/data.md), told apart by the function's parameter names:
  per sample  fn(prompt, response, answer, **row) -> float | (float, bool) | None
  verl        fn(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ..}
              (verl's ``compute_score``: a function that names ``solution_str``; called by keyword)
  batched     fn(prompts, completions, **columns) -> list of those   (TRL's convention: a function
              that names ``prompts`` or ``completions``, or takes only ``**kwargs``, is called by
              keyword, as TRL calls it: prompts=, completions=, completion_ids= (each response's
              token ids), trainer_state= (engine/rewards/trainer_state.py) and every column by
              name; ``async def`` functions are awaited)

``row`` holds every dataset column except the prompt and the answer (verl's nested
``reward_model``, ``data_source`` and ``extra_info`` included, plus ``ground_truth`` taken from
``reward_model.ground_truth``). A function receives only the keyword arguments it names,
unless it takes ``**kwargs``. In the batched convention a message prompt's completion is
``[{"role": "assistant", "content": text}]``, as in TRL, and each column is a list.
A per-sample function gets ``trainer_state`` and ``completion_ids`` (its own) when it names them.
``None`` means "does not apply" (TRL's None, made NaN there): the sample is left out of that
function's mean and adds nothing to the weighted sum (TRL's nansum); engine/rewards/compute.py
warns when every function returned None for a sample.
"""

from __future__ import annotations

import inspect
import math
import numbers
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

_FNS: dict[str, Callable] = {}


@dataclass(frozen=True)
class Sample:
    prompt: object                    # text, or a list of {role, content} messages
    response: str
    answer: str
    row: dict = field(default_factory=dict)
    origin: str = ""                  # where the row came from, e.g. "train.parquet row 17"
    completion_ids: Optional[list] = None  # the response's token ids, as sampled (TRL's completion_ids)


def resolve(target: str) -> Callable:
    fn = _FNS.get(target)
    if fn is None:
        from engine.rewards.spec import import_target

        fn = _FNS[target] = import_target(target)
    return fn


_PARAMS: dict[int, Optional[frozenset]] = {}  # id(fn) -> keyword names it accepts (None: any)


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The keyword arguments ``fn`` names (all of them if it takes ``**kwargs``)."""
    key = id(fn)
    if key not in _PARAMS:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = None
        if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
            _PARAMS[key] = None
        else:
            _PARAMS[key] = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    names = _PARAMS[key]
    return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}


VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_ARGS = ("prompts", "completions")
CALL_ARGS = ("completion_ids", "trainer_state")  # passed by name to any function that names them (TRL's too)


def _names(fn: Callable) -> tuple[set, bool]:
    """(the parameter names ``fn`` takes, whether it takes ``**kwargs``); (set(), True) when unknown."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    return {p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params)


def is_verl_style(fn: Callable) -> bool:
    """verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``."""
    return "solution_str" in _names(fn)[0]


def is_keyword_batched(fn: Callable) -> bool:
    """TRL's reward function: it names prompts, completions or completion_ids (and not the
    per-sample prompt/response), or takes only ``**kwargs`` (and trainer_state)."""
    names, var_kw = _names(fn)
    if names & {"prompt", "response"}:
        return False
    return bool(names & {*TRL_ARGS, "completion_ids"}) or \
        (var_kw and names <= {"kwargs", "kw", "kwds", "trainer_state"} and bool(names))


def _await(value):
    if inspect.isawaitable(value):
        import asyncio

        async def wait():
            return await value
        return asyncio.run(wait())
    return value


def _asked(fn: Callable, s: Optional[Sample], state) -> dict:
    """completion_ids / trainer_state for a per-sample function that names them (not through
    ``**row``: a row's columns stay exactly the dataset's)."""
    names = _names(fn)[0]
    asked = {"completion_ids": s.completion_ids if s is not None else None, "trainer_state": state}
    return {k: v for k, v in asked.items() if k in names}


def call_per_sample(fn: Callable, s: Sample, state=None):
    if is_verl_style(fn):  # verl passes every argument by keyword
        kwargs = {"data_source": s.row.get("data_source"), "solution_str": s.response, "ground_truth": s.answer,
                  "extra_info": s.row.get("extra_info")}
        return _await(fn(**_accepted(fn, kwargs)))
    row = {k: v for k, v in s.row.items() if k not in ("prompt", "response", "answer") + CALL_ARGS}
    return _await(fn(s.prompt, s.response, s.answer, **_accepted(fn, row), **_asked(fn, s, state)))


def completion_of(s: Sample):
    return [{"role": "assistant", "content": s.response}] if isinstance(s.prompt, list) else s.response


def call_batched(fn: Callable, samples: list[Sample], state=None) -> list:
    """As TRL's GRPOTrainer calls a reward function: prompts=, completions=, completion_ids=,
    trainer_state= and every dataset column (one value per sample) by name; a function receives
    those it names, or all of them through ``**kwargs``."""
    keys: dict[str, None] = {"answer": None}
    for s in samples:
        keys.update(dict.fromkeys(s.row))
    columns = {k: [s.answer if k == "answer" else s.row.get(k) for s in samples] for k in keys
               if k not in TRL_ARGS + CALL_ARGS}
    columns |= {"completion_ids": [s.completion_ids for s in samples], "trainer_state": state}
    prompts, completions = [s.prompt for s in samples], [completion_of(s) for s in samples]
    if is_keyword_batched(fn):  # as TRL calls it: every argument by keyword
        return _await(fn(**_accepted(fn, {"prompts": prompts, "completions": completions, **columns})))
    return _await(fn(prompts, completions, **_accepted(fn, columns)))


class BadValue(Exception):
    pass


def as_score(value) -> tuple[Optional[float], Optional[bool]]:
    """A returned value -> (score, correct or None). Raises BadValue for anything else. A dict is
    verl's: ``{"score": float, "acc": bool, ...}`` (``acc``, when present, is the correctness)."""
    correct = None
    if isinstance(value, dict):
        if "score" not in value:
            raise BadValue(f"returned a dict without a 'score' key ({', '.join(map(str, list(value)[:6]))}); "
                           f"return a float, (score, correct), or verl's {{'score': ...}}")
        acc = value.get("acc")
        value = (value["score"], bool(acc)) if isinstance(acc, (bool, numbers.Real)) else value["score"]
    if isinstance(value, tuple):
        if len(value) != 2:
            raise BadValue(f"returned a tuple of {len(value)} values; return a float or (score, correct)")
        value, correct = value
        if not isinstance(correct, (bool, numbers.Integral)) and not hasattr(correct, "__bool__"):
            raise BadValue(f"returned (score, {correct!r}); correct must be a bool")
        correct = bool(correct)
    if value is None:
        return None, correct  # does not apply: left out of this function's mean, 0 in the sum
    if isinstance(value, (numbers.Real, bool)) or (hasattr(value, "__float__") and not isinstance(value, str)):
        try:
            score = float(value)
        except (TypeError, ValueError, OverflowError):
            raise BadValue(f"returned {value!r:.80}, not a number a float can hold") from None
        if math.isnan(score) or math.isinf(score):
            raise BadValue(f"returned {score}; a reward must be finite")
        return score, correct
    raise BadValue(f"returned {type(value).__name__} {value!r:.80}; return a float, (score, correct) or None")


def as_correct(value) -> bool:
    if isinstance(value, tuple) and len(value) == 2:
        value = value[1]
    if isinstance(value, (bool, numbers.Real)) or hasattr(value, "__bool__"):
        return bool(value)
    raise BadValue(f"returned {value!r:.80}; a correctness check returns a bool")


def batch_values(out, n: int) -> list:
    """A batched reward's return value as a list of ``n`` values: a list or tuple, a 1-D numpy array
    or torch tensor (``tolist()``), or any other iterable but text and mappings (a generator)."""
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        out = out.tolist()  # numpy / torch: their scalars become Python numbers
    elif not isinstance(out, (list, tuple, str, bytes, dict)) and hasattr(out, "__iter__"):
        out = list(out)
    if not isinstance(out, (list, tuple)):
        raise BadValue(f"returned {type(out).__name__} {out!r:.80} for a batch of {n}; a batched reward returns a "
                       f"list with one value per completion")
    if len(out) != n:
        raise BadValue(f"returned {len(out)} value(s) for a batch of {n}; a batched reward returns one value per "
                       f"completion")
    return list(out)


def _where(exc: BaseException) -> str:
    """The innermost frame of the user's code, e.g. "myrewards.py:3 in acc"."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if "/engine/rewards/" not in f.filename.replace("\\", "/")]
    f = (mine or frames)[-1] if frames else None
    return f"{f.filename}:{f.lineno} in {f.name}" if f else ""


def run_call(target: str, batched: bool, role: str, samples: list[Sample], state=None) -> tuple:
    """One call, made wherever it runs. Returns ("ok", [(score or None, correct), ...]) or
    ("err", "ExcType: message", where). Never raises: worker processes send this back.
    ``state``: the TrainerState a function that asks for ``trainer_state`` receives."""
    try:
        fn = resolve(target)
        if batched:
            values = batch_values(call_batched(fn, samples, state), len(samples))
        else:
            values = [call_per_sample(fn, s, state) for s in samples]
        if role == "correct":
            return "ok", [(0.0, as_correct(v)) for v in values]
        return "ok", [as_score(v) for v in values]
    except BadValue as e:
        return "err", f"bad return value: {e}", ""
    except BaseException as e:  # noqa: BLE001 - the user's code may raise anything; it is reported, not hidden
        if isinstance(e, KeyboardInterrupt):
            raise
        return "err", f"{type(e).__name__}: {e}", _where(e)
