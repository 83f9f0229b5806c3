"""eval.jsonl: every response `rl eval` scored, one JSON object a line, each starting with
``{"eval": "greedy"`` or ``{"eval": "sampled"`` (how a later `rl eval` knows the file is one it
may replace; any other file at that path is refused). Written atomically: a temporary sibling,
fsynced, renamed into place, so the path holds the old file or the whole new one, never a part."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from engine.errors import UserError

MAGIC = b'{"eval": "'


def check_output(path: str) -> None:
    """Before any generation: the output path can be (re)written (engine/user_paths.py)."""
    from engine.user_paths import check_output_file

    check_output_file(path, "eval.output", magic=MAGIC, kind="file an earlier `rl eval` wrote")


def write_rows(path: str, rows: list[dict]) -> None:
    from engine.user_paths import os_problem, shown

    out = Path(path)
    text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        tmp = None
        dfd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise UserError(f"eval.output {shown(e.filename or out)} {os_problem(e)}. Choose a path you can "
                        f"write to (eval.output=...).", title="cannot write there") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
