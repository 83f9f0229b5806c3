"""How one reward call is made and what it may return. Imported by spawned reward workers:
keep it free of torch and of the trainer.

Conventions (docs/data.md):
  per sample  fn(prompt, response, answer, **row) -> float | (float, bool) | None
  batched     fn(prompts, completions, **columns) -> list of those   (TRL's convention)

``row`` holds every dataset column except the prompt and the answer (verl's nested
``reward_model``, ``data_source`` and ``extra_info`` included, plus ``ground_truth`` taken from
``reward_model.ground_truth``). A function receives only the keyword arguments it names,
unless it takes ``**kwargs``. In the batched convention a message prompt's completion is
``[{"role": "assistant", "content": text}]``, as in TRL, and each column is a list.
``None`` means "does not apply" (TRL) and scores 0.
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


def call_per_sample(fn: Callable, s: Sample):
    row = {k: v for k, v in s.row.items() if k not in ("prompt", "response", "answer")}
    return fn(s.prompt, s.response, s.answer, **_accepted(fn, row))


def completion_of(s: Sample):
    return [{"role": "assistant", "content": s.response}] if isinstance(s.prompt, list) else s.response


def call_batched(fn: Callable, samples: list[Sample]) -> list:
    keys: dict[str, None] = {"answer": None}
    for s in samples:
        keys.update(dict.fromkeys(s.row))
    columns = {k: [s.answer if k == "answer" else s.row.get(k) for s in samples] for k in keys
               if k not in ("prompts", "completions")}
    return fn([s.prompt for s in samples], [completion_of(s) for s in samples], **_accepted(fn, columns))


class BadValue(Exception):
    pass


def as_score(value) -> tuple[float, Optional[bool]]:
    """A returned value -> (score, correct or None). Raises BadValue for anything else."""
    correct = None
    if isinstance(value, tuple):
        if len(value) != 2:
            raise BadValue(f"returned a tuple of {len(value)} values; return a float or (score, correct)")
        value, correct = value
        if not isinstance(correct, (bool, numbers.Integral)) and not hasattr(correct, "__bool__"):
            raise BadValue(f"returned (score, {correct!r}); correct must be a bool")
        correct = bool(correct)
    if value is None:
        return 0.0, correct
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


def run_call(target: str, batched: bool, role: str, samples: list[Sample]) -> tuple:
    """One call, made wherever it runs. Returns ("ok", [(score, correct), ...]) or
    ("err", "ExcType: message", where). Never raises: worker processes send this back."""
    try:
        fn = resolve(target)
        if batched:
            values = batch_values(call_batched(fn, samples), len(samples))
        else:
            values = [call_per_sample(fn, s) for s in samples]
        if role == "correct":
            return "ok", [(0.0, as_correct(v)) for v in values]
        return "ok", [as_score(v) for v in values]
    except BadValue as e:
        return "err", f"bad return value: {e}", ""
    except BaseException as e:  # noqa: BLE001 - the user's code may raise anything; it is reported, not hidden
        if isinstance(e, KeyboardInterrupt):
            raise
        return "err", f"{type(e).__name__}: {e}", _where(e)
