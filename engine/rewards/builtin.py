"""Built-in verifiable rewards, usable as ``task.reward_fn=rl:<name>``.

  rl:math_boxed    the last \\boxed{...} in the response equals the answer   -> (1.0|0.0, correct)
                   (mathematically, by math-verify, when the `data` extra is installed)
  rl:math_verify   Hugging Face's math-verify: the response's final answer (boxed, LaTeX or plain)
                   is mathematically equal to the answer (1/2 = 0.5 = \\frac{1}{2}, 2\\sqrt{2} =
                   \\sqrt{8}, sets, intervals, ...)                           -> (1.0|0.0, correct)
  rl:gsm8k         the number after the last "####" (else the last number)
                   equals the answer's (a gsm8k answer "... #### 72" works) -> (1.0|0.0, correct)
  rl:exact_match   the stripped response equals the stripped answer        -> (1.0|0.0, correct)
  rl:boxed_format  1.0 when the response gives a \\boxed{...} answer
  rl:think_format  1.0 when the response is <think>...</think> followed by a non-empty answer
  rl:by_data_source  verl's default: each row scored by the rule for its ``data_source``
                   (openai/gsm8k -> gsm8k; MATH, MATH-500, AIME, DAPO-Math -> math_boxed)

Answers are compared after light normalisation (spaces, a surrounding $...$, \\text{}, a
trailing period, thousands separators), and numerically when both sides are numbers.
"""

from __future__ import annotations

import re
from typing import Optional

_HASH = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_THINK = re.compile(r"\s*<think>.*?</think>\s*\S.*", re.DOTALL)


def last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def normalize(ans: str) -> str:
    s = str(ans).strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.strip("$ ").rstrip(".").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def same_answer(a: Optional[str], b: str) -> bool:
    if a is None:
        return False
    x, y = normalize(a), normalize(b)
    if x == y:
        return True
    try:
        return abs(float(x) - float(y)) <= 1e-6 * max(1.0, abs(float(y)))
    except ValueError:
        return False


def gsm8k_final(text: str) -> Optional[str]:
    """The answer after the last "####", else the last number in the text."""
    tagged = _HASH.findall(text)
    if tagged:
        nums = _NUMBER.findall(tagged[-1])
        return nums[0] if nums else tagged[-1].strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _scored(ok: bool) -> tuple[float, bool]:
    return float(ok), ok


def math_equal(pred: str, gold: str) -> Optional[bool]:
    """Whether two answers are mathematically equal by math-verify (parse both, compare symbolically
    and numerically); None when math-verify is not installed. Its time limits use SIGALRM, which
    only the main thread may set: elsewhere (a reward thread) they are off."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    import threading

    main = threading.current_thread() is threading.main_thread()
    limit = {} if main else {"parsing_timeout": None}
    wrap = lambda t: t if ("$" in t or "\\boxed" in t) else f"${t}$"  # noqa: E731  (plain answers as math)
    try:
        g, p = parse(wrap(gold), **limit), parse(wrap(pred), **limit)
        return bool(g and p and verify(g, p, **({} if main else {"timeout_seconds": None})))
    except Exception:  # noqa: BLE001 - a parser failure on odd text is "not equal", never a crashed run
        return False


def math_verify(prompt, response: str, answer: str) -> tuple[float, bool]:
    try:
        from math_verify import parse, verify  # noqa: F401
    except ImportError:
        raise ImportError("rl:math_verify needs the math-verify package: pip install 'rl[data]' "
                          "(or pip install math-verify)") from None
    pred = last_boxed(response)
    return _scored(math_equal(pred if pred is not None else response, last_boxed(answer) or str(answer)) is True)


def math_boxed(prompt, response: str, answer: str) -> tuple[float, bool]:
    ref = last_boxed(answer) or answer
    pred = last_boxed(response)
    if pred is None:
        return _scored(False)
    return _scored(same_answer(pred, ref) or math_equal(pred, ref) is True)


def gsm8k(prompt, response: str, answer: str) -> tuple[float, bool]:
    ref = gsm8k_final(answer) if "####" in answer else answer
    return _scored(ref is not None and same_answer(gsm8k_final(response), ref))


def exact_match(prompt, response: str, answer: str) -> tuple[float, bool]:
    return _scored(response.strip() == str(answer).strip())


def boxed_format(prompt, response: str, answer: str) -> float:
    return float(last_boxed(response) is not None)


def think_format(prompt, response: str, answer: str) -> float:
    return float(_THINK.fullmatch(response) is not None)


# verl's data_source values (its examples/data_preprocess and recipes) -> the rule that scores them
DATA_SOURCE_RULES = {
    "openai/gsm8k": gsm8k, "gsm8k": gsm8k,
    "lighteval/MATH": math_boxed, "DigitalLearningGmbH/MATH-lighteval": math_boxed,
    "HuggingFaceH4/MATH-500": math_boxed, "math_dapo": math_boxed, "math": math_boxed,
}
_DATA_SOURCE_PREFIXES = (("aime", math_boxed),)


def rule_for(data_source) -> Optional[object]:
    """The built-in rule for a verl ``data_source`` value, or None when it has none."""
    if not isinstance(data_source, str):
        return None
    rule = DATA_SOURCE_RULES.get(data_source)
    if rule is None:
        rule = next((r for prefix, r in _DATA_SOURCE_PREFIXES if data_source.lower().startswith(prefix)), None)
    return rule


def by_data_source(prompt, response: str, answer: str, data_source=None) -> tuple[float, bool]:
    rule = rule_for(data_source)
    if rule is None:
        known = ", ".join(sorted(DATA_SOURCE_RULES))
        raise ValueError(
            f"rl:by_data_source has no rule for data_source={data_source!r} (it knows {known} and aime*). Name "
            f"the reward for this data instead, e.g. task.reward_fn=rl:math_boxed or your own module:function")
    return rule(prompt, response, answer)


BUILTINS = {f.__name__: f for f in (math_boxed, math_verify, gsm8k, exact_match, boxed_format, think_format,
                                    by_data_source)}
