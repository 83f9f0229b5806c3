"""A task from a prompt file (JSONL or Parquet) with a user reward function."""

from __future__ import annotations

import importlib
import json
import os
import random
import string
import sys
from pathlib import Path

from engine.config.schema import TaskConfig
from engine.errors import ConfigError
from engine.tasks.base import Example, Task


def load_reward_fn(spec: str):
    """'pkg.module:function' -> callable; the current directory is importable."""
    if ":" not in spec:
        raise ConfigError(f"`task.reward_fn={spec}` must look like `module:function`, e.g. mypkg.rewards:exact_match.",
                          title="invalid config value")
    mod_name, fn_name = spec.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"`task.reward_fn={spec}`: cannot import `{mod_name}` ({e}). Run `rl` from the directory "
                          f"that contains it, or install it.", title="invalid config value") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"`task.reward_fn={spec}`: `{mod_name}` has no function `{fn_name}`.",
                          title="invalid config value")
    return fn


def read_rows(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        raise ConfigError(f"`task.path={path}` does not exist.", title="invalid config value")
    if kind == "jsonl":
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{i} is not valid JSON ({e.msg}).", title="invalid prompt file") from None
        return rows
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Reading Parquet needs pyarrow: `pip install pyarrow`, or convert the file to JSONL "
                          "and use task=jsonl.", title="missing dependency") from None
    return pq.read_table(path).to_pylist()


def make_file_task(cfg: TaskConfig, seed: int) -> Task:
    rows = read_rows(Path(cfg.path), cfg.name)
    examples = []
    for i, row in enumerate(rows):
        if cfg.prompt_key not in row:
            raise ConfigError(f"{cfg.path}: row {i} has no `{cfg.prompt_key}` column (task.prompt_key). "
                              f"Columns: {', '.join(row)}.", title="invalid prompt file")
        examples.append(Example(str(row[cfg.prompt_key]), str(row.get(cfg.answer_key, ""))))
    if not examples:
        raise ConfigError(f"{cfg.path} has no prompts.", title="invalid prompt file")
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    n_val = min(cfg.num_val, len(examples) // 5)
    val = [examples[i] for i in order[:n_val]]
    train = [examples[i] for i in order[n_val:]]
    fn = load_reward_fn(cfg.reward_fn)
    # printable ASCII lets the built-in character tokenizer serve the tiny model; a real
    # model (model.path / a preset) brings its own tokenizer and ignores this
    return Task(cfg.name, train, val, lambda p, r, a: float(fn(p, r, a)), alphabet=string.printable)
