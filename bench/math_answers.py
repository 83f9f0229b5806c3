"""The math-answer table of docs/data.md: how `rl:math_boxed` judges a boxed answer against a
reference, before math-verify (commit fca5534: normalised text, then numbers) and now (math-verify
decides mathematical equality). Each case says whether the two are equal as mathematics, so the
table shows what each version gets right and wrong, including what math-verify still misses.

    python bench/math_answers.py          # prints the Markdown table docs/data.md holds

"before" is fca5534's engine/rewards/builtin.py, read from git (`?` when the history is not
there); "now" is this tree's. tests/test_math_answers.py checks that the table in docs/data.md
is this script's output for the "now" column (and "before", where git has fca5534).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE_COMMIT = "fca5534"

# (response's \boxed{} content, reference answer, equal as mathematics?)
CASES: list[tuple[str, str, bool]] = [
    # the 8 (issue 42)
    (r"\frac{1}{2}", "0.5", True),
    (r"2\sqrt{2}", r"\sqrt{8}", True),
    ("1/2", r"\frac{1}{2}", True),
    ("0.50", "1/2", True),
    (r"\frac{6}{4}", r"\frac{3}{2}", True),
    (r"\dfrac{1}{3}", r"\frac{1}{3}", True),
    ("3.0", "3", True),
    (r"x^2+2x+1", r"(x+1)^2", True),
    # different answers that must stay wrong
    ("0.51", "1/2", False),
    (r"\sqrt{2}", r"\sqrt{8}", False),
    ("2", "3", False),
    (r"x^2+1", r"(x+1)^2", False),
    # 20 more: sets, intervals, units, degrees, pi, scientific notation, negatives, roots,
    # equations, factoring, percentages, complex numbers, matrices
    (r"\{1,2,3\}", r"\{3,2,1\}", True),
    (r"(-\infty, 2)", "x<2", True),
    (r"5\text{ cm}", "5", True),
    (r"90^\circ", "90", True),
    (r"\pi/2", r"\frac{\pi}{2}", True),
    (r"2\pi", "6.283185307", True),
    (r"1.5\times10^{3}", "1500", True),
    (r"-\frac{1}{2}", "-0.5", True),
    (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}", True),
    ("x=3", "3", True),
    ("1,000,000", "10^6", True),
    ("x^2-1", "(x-1)(x+1)", True),
    (r"50\%", "0.5", True),
    ("2+2i", "2(1+i)", True),
    (r"\{1,2\}", r"\{1,2,3\}", False),
    ("(1,3)", "[1,3]", False),
    ("-3", "3", False),
    (r"\pi", "3.14", False),
    (r"\frac{1}{3}", "0.333", False),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix}1&2\\4&3\end{pmatrix}", False),
]


def response(boxed: str) -> str:
    return rf"so the answer is \boxed{{{boxed}}}."


def before_fn():
    """fca5534's rl:math_boxed, or None where git does not have that commit."""
    try:
        text = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:engine/rewards/builtin.py"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "builtin_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("builtin_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.math_boxed


def judged(fn, boxed: str, answer: str) -> bool:
    return bool(fn("", response(boxed), answer)[1])


def verdict(fn, boxed: str, answer: str, equal: bool) -> str:
    if fn is None:
        return "?"
    return "right" if judged(fn, boxed, answer) == equal else "wrong"


def rows() -> list[tuple[str, str, str, str, str]]:
    """(boxed, answer, equal?, before, now) per case; before/now: right or wrong."""
    sys.path.insert(0, str(ROOT))
    from engine.rewards.builtin import math_boxed

    before = before_fn()
    return [(b, a, "yes" if eq else "no", verdict(before, b, a, eq), verdict(math_boxed, b, a, eq))
            for b, a, eq in CASES]


def table(rs) -> str:
    code = lambda s: "`" + s.replace("|", r"\|") + "`"  # noqa: E731
    lines = ["| response's `\\boxed{}` | answer | equal? | rl before (fca5534) | rl now |", "|---|---|---|---|---|"]
    lines += [f"| {code(b)} | {code(a)} | {eq} | {bf} | {now} |" for b, a, eq, bf, now in rs]
    rs = list(rs)
    lines.append(f"| **right** | | | {sum(r[3] == 'right' for r in rs)} of {len(rs)} | "
                 f"{sum(r[4] == 'right' for r in rs)} of {len(rs)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(rows()))
