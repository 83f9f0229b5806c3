"""Sample rows: a few prompt/response/reward rows from a step, kept in ``samples.jsonl``
(every trainer.sample_log_freq steps) and sent to each logger."""

from __future__ import annotations

import json
from pathlib import Path

from engine import json_safe

SAMPLES_FILE = "samples.jsonl"


def is_sample_step(step: int, freq: int) -> bool:
    return bool(freq) and step % freq == 0


def pick_rows(step: int, n: int, prompts: list[str], responses: list[str], rewards: list[float],
              advantages: list[float], answers: list, group: int) -> list[dict]:
    """``n`` rows spread over the batch (distinct prompts first): row i of prompt i * stride."""
    total = len(responses)
    n = min(n, total)
    groups = total // max(group, 1)
    if groups >= n:  # one response from each of n prompts spread over the batch
        idx = [(i * groups // n) * group for i in range(n)]
    else:
        idx = [i * total // n for i in range(n)]
    return [{"step": step, "prompt": prompts[i // group], "response": responses[i], "reward": float(rewards[i]),
             "advantage": float(advantages[i]), "answer": answers[i // group]} for i in idx]


def append_samples(run_dir: Path, rows: list[dict]) -> None:
    from engine.user_paths import append_to_run_file

    if rows:
        append_to_run_file(Path(run_dir) / SAMPLES_FILE, "".join(json.dumps(r, default=str) + "\n" for r in rows).encode())


def read_samples(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / SAMPLES_FILE
    if not p.exists():
        return []
    return [json_safe.loads(line) for line in p.read_text().splitlines() if line.strip()]
