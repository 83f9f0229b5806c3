"""``json.loads`` for files another program (or person) may have written: a nesting deep enough
to exhaust the parser's recursion (``[[[[...`` 100k levels: a few hundred KB) raises
``json.JSONDecodeError`` (a ValueError), as any other malformed JSON does, never a
``RecursionError`` that escapes every reader's ``except ValueError`` as a traceback.
Every reader of a run directory's or model directory's JSON goes through :func:`loads`."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to parse", text if isinstance(text, str) else "", 0) from None
