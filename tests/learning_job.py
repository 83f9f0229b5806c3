"""bench/learning.py's ``count`` job at the CI size (a 0.5M-parameter Llama, vocabulary 128), for the
tests that run it through ``rl train``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIZE = (128, 2, 4, 344, 128)  # hidden, layers, heads, intermediate, vocabulary


def count_job(tmp_path_factory, name: str) -> tuple[Path, Path]:
    """(work dir holding ``model/``, the job's dir with train.jsonl and learning_reward.py)."""
    pytest.importorskip("tokenizers")
    sys.path.insert(0, str(ROOT))
    from bench.learning import build_job

    work = tmp_path_factory.mktemp(name)
    return work, build_job(work, "count", SIZE)
