"""docs/data.md's math-answer table is what rl does (issue 42, part 2): the table between the
math-answers markers is bench/math_answers.py's output, its "rl now" column computed by this
tree's rl:math_boxed, its "before" column by fca5534's (where git has that commit)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def doc_table() -> str:
    text = (ROOT / "docs" / "data.md").read_text()
    m = re.search(r"<!-- math-answers: bench/math_answers.py -->\n(.*?)<!-- /math-answers -->", text, re.DOTALL)
    assert m, "docs/data.md lost its math-answers markers"
    return m.group(1).strip()


def test_the_docs_math_table_is_what_rl_math_boxed_does_now():
    pytest.importorskip("math_verify")
    from bench.math_answers import CASES, before_fn, rows, table

    assert len(CASES) == 32  # the 8, 4 different answers, 20 more
    computed = rows()
    if before_fn() is None:  # no git history: compare every column but "before"
        strip = lambda t: [line.rsplit("|", 3)[0] + "|" + line.rsplit("|", 2)[1] for line in t.splitlines()]  # noqa: E731
        assert strip(doc_table()) == strip(table(computed))
    else:
        assert doc_table() == table(computed), "regenerate it: python bench/math_answers.py"
    assert [now for *_, now in computed].count("right") == 30  # math-verify misses 50% = 0.5 and 2+2i = 2(1+i)
