"""``task=dataset`` (and its aliases ``jsonl`` / ``parquet``): prompts from your own data,
scored by your reward functions. Loading: engine/data/load.py; layouts: engine/data/formats.py."""

from __future__ import annotations

import random
import string
from pathlib import Path

from engine.config.schema import TaskConfig
from engine.data.fingerprint import XXH3 as FINGERPRINT_ALGORITHM, fingerprint_path
from engine.data.formats import check_columns, detect_format, to_examples
from engine.data.load import open_dataset, pick_split
from engine.errors import ConfigError
from engine.rewards.call import resolve
from engine.rewards.spec import BUILTIN_MODULE, check_signature, user_reward_specs
from engine.tasks.base import Task

DATA_SOURCE_TARGET = f"{BUILTIN_MODULE}:by_data_source"  # rl:by_data_source, whose data is checked here


def make_dataset_task(cfg: TaskConfig, seed: int) -> Task:
    if not cfg.path:
        raise ConfigError(f"`task={cfg.name}` needs `task.path=` (a Parquet/JSONL/JSON/Arrow file, a save_to_disk "
                          f"directory, or a dataset name in the local Hugging Face cache).", title="invalid config")
    opened = open_dataset(cfg.path, task_name=cfg.name, subset=cfg.subset, split=cfg.split)
    train_ds = pick_split(opened, cfg.split, "task.split")
    val_ds = pick_split(opened, cfg.val_split, "task.val_split") if cfg.val_split else None
    columns = list(train_ds.column_names)
    if len(train_ds) == 0:
        raise ConfigError(f"{opened.source} (split {cfg.split}) has no rows.", title="invalid dataset")
    rows = train_ds.to_list()
    fmt = cfg.format if cfg.format != "auto" else detect_format(columns, rows[0], cfg.prompt_key)
    name = Path(opened.source).name if opened.kind == "file" else opened.source
    origin = name if opened.kind == "file" else f"{name} split {cfg.split}"
    check_columns(columns, fmt, cfg.prompt_key, cfg.answer_key, origin)
    train = to_examples(rows, fmt, cfg.prompt_key, cfg.answer_key, origin)
    if val_ds is not None:
        val_rows = val_ds.select(range(min(cfg.num_val, len(val_ds)))).to_list()
        val = to_examples(val_rows, fmt, cfg.prompt_key, cfg.answer_key, f"{name} split {cfg.val_split}")
    else:  # hold out a seeded sample of the train split
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        n_val = min(cfg.num_val, len(train) // 5)
        val = [train[i] for i in order[:n_val]]
        train = [train[i] for i in order[n_val:]]
    specs = user_reward_specs(cfg)
    visible = set(columns) - {cfg.prompt_key} | ({"ground_truth"} if fmt == "verl" else set())
    for s in specs:
        check_signature(s, resolve(s.target), visible | ({"answer"} if s.batched else set()))
    if any(s.target == DATA_SOURCE_TARGET for s in specs):
        _check_data_sources(rows + (val_rows if val_ds is not None else []), origin)
    rewards = [s for s in specs if s.role == "reward"]
    first = resolve(rewards[0].target) if rewards else None  # None: a reward model or remote scorer scores
    info = {"format": fmt, "source": opened.source, "kind": opened.kind, "split": cfg.split,
            "val_split": cfg.val_split or None, "columns": columns, "rows": {"train": len(train), "val": len(val)},
            "fingerprint": fingerprint_path(cfg.path, cfg.subset), "fingerprint_algorithm": FINGERPRINT_ALGORITHM,
            "path": cfg.path, "subset": cfg.subset or None}
    # printable ASCII lets the built-in character tokenizer serve the tiny model on text prompts; a
    # real model (model.path / a preset) brings its own tokenizer and ignores this
    return Task(cfg.name, train, val, first, alphabet=string.printable, reward_specs=specs, data_info=info)


def _check_data_sources(rows: list[dict], origin: str) -> None:
    """rl:by_data_source scores each row by its data_source: refuse, before the run, data whose
    rows have none or one it has no rule for (else the first such row stops the run)."""
    from engine.rewards.builtin import DATA_SOURCE_RULES, rule_for

    values = {r.get("data_source") for r in rows}
    unknown = sorted(str(v) for v in values if v is not None and rule_for(v) is None)
    problems = (["has rows without a data_source column"] if None in values else []) + \
        ([f"has data_source values it has no rule for: {', '.join(unknown)[:300]}"] if unknown else [])
    if problems:
        raise ConfigError(
            f"`task.reward_fn=rl:by_data_source` scores each row by the rule for its data_source, and {origin} "
            f"{' and '.join(problems)}. It knows {', '.join(sorted(DATA_SOURCE_RULES))} and aime*. Name the reward "
            f"for this data instead (task.reward_fn=rl:math_boxed, rl:gsm8k, or your own module:function).",
            title="invalid config")
