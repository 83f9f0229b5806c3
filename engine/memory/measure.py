"""Entry points behind ``rl mem-report``: each returns a report object, none prints.

    report_from_run("ckpt/")                       # what a run recorded in memory.jsonl
    engine.trainer.memory_run.measure_default(["data.train_batch_size=4"])   # run ONE step (real trainer) and report it
    estimate_only(["model.path=llama-70b", "trainer.nprocs=8"], device_memory="80GiB")

A report from a run puts the estimate for the run's own config beside what rank 0 measured.
The estimate's activations and logits depend on the micro-batch shape, and a run's batches
are usually much shorter than the config's limit (``data.max_prompt_length +
rollout.max_new_tokens``: 76 tokens for the default job, whose sequences are about 14), so
the comparison estimate is built at the sequence length the run actually had:

1. ``micro_batch_shapes`` in metrics.jsonl (rows, tokens) when the trainer writes them;
2. else the rollout's KV cache on rank 0 (torch sampler): the cache holds every generated
   sequence at the batch's full length, so its bytes / (KV bytes per token x sequences) is the
   longest prompt + response (the training rows are at most one token longer);
3. else the config's limit, with a note.

The offload what-if and the fixes come from the same estimate; the notes give the config's
worst-case peak as well when it differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from engine.errors import ConfigError, UserError
from engine.memory.report import RECORDS_FILE, MemoryReport, PhaseRecord, build_report

# Keys `measure_default` sets itself (one step, in a temporary directory, nothing saved).
ONE_STEP_OVERRIDES = ("trainer.total_steps=1", "trainer.val_freq=0", "checkpoint.save_final=false",
                      "checkpoint.save_freq=0")
_RESERVED_KEYS = ("trainer.total_steps", "trainer.val_freq", "checkpoint.save_final", "checkpoint.save_freq",
                  "checkpoint.dir", "checkpoint.overwrite")


@dataclass
class MemoryReportWithNotes(MemoryReport):
    """A MemoryReport plus what ``rl mem-report`` needs to say about how it was made: the
    sequence length the comparison used and where it came from, and why something is missing."""

    notes: list = field(default_factory=list)
    seq_len: Optional[int] = None          # tokens per sequence the estimate was built at
    seq_len_source: str = ""               # "metrics", "kv_cache", "config"
    run_dir: Optional[str] = None


# ---- --device-memory -------------------------------------------------------------------------
def device_memory_bytes(value: Union[None, int, str]) -> Optional[int]:
    """'80GiB' / '141GB' / 85899345920 -> bytes; None stays None. Refuses sizes <= 0."""
    if value is None or value == "":
        return None
    from engine.memory.estimate import parse_bytes

    n = int(value) if isinstance(value, int) else parse_bytes(str(value))
    if n <= 0:
        raise ConfigError(f"--device-memory {value!r} is not a positive size; write e.g. 80GiB, 141GB or "
                          "81920MiB.", title="invalid memory size")
    return n


# ---- reading a run ---------------------------------------------------------------------------
def _run_paths(path) -> tuple[Path, Path, list[str]]:
    """(run dir, memory.jsonl, notes) for a run dir, one of its step_N/ dirs, or memory.jsonl."""
    p = Path(path).expanduser()
    notes: list[str] = []
    if not p.exists():
        raise UserError(f"{p} does not exist. Give the run directory that `rl train` wrote "
                        "(checkpoint.dir, e.g. `rl mem-report ckpt/`).", title="no such run")
    if p.is_file():
        if p.name != RECORDS_FILE and p.suffix != ".jsonl":
            raise UserError(f"{p} is a file, not a run directory. Give the run directory that `rl train` wrote "
                            f"(it holds {RECORDS_FILE}), e.g. `rl mem-report ckpt/`.", title="not a run")
        return p.parent, p, notes
    if not (p / RECORDS_FILE).is_file() and (p.parent / RECORDS_FILE).is_file() and p.name.startswith("step_"):
        notes.append(f"{p.name}/ is a checkpoint; memory records are per run, read from {p.parent}/")
        p = p.parent
    f = p / RECORDS_FILE
    if not f.is_file():
        if (p / "config.yaml").is_file() or (p / "run.json").is_file():
            raise UserError(f"{p} is a run directory without {RECORDS_FILE}: runs record per-phase memory there "
                            "from their first step, so this one never finished a step or was written by an older "
                            "rl. Estimate its config instead: `rl mem-report --estimate <the run's overrides>`.",
                            title="no memory records")
        raise UserError(f"{p} is not a run directory (no {RECORDS_FILE}, no config.yaml). Give the directory "
                        "`rl train` wrote (checkpoint.dir, e.g. `rl mem-report ckpt/`).", title="not a run")
    return p, f, notes


def _load_records(path: Path, notes: list[str]) -> list[PhaseRecord]:
    """The phase records in ``path``. A last line that is not JSON is what a run killed while
    appending leaves: it is skipped, with a note (as `rl plot` skips one in metrics.jsonl); a
    damaged line anywhere else, or a JSON line that is not a record, is refused."""
    from engine.user_paths import read_jsonl

    out = []
    rows, bad = read_jsonl(path, str(path))  # a FIFO or a device is refused unread; bad bytes make a bad line
    if bad and rows and bad[-1] > max(i for i, _ in rows):  # only after a record: garbage alone is damage
        notes.append(f"{path.name} line {bad[-1]} is a partial record (a run stopped while writing it); skipped")
        bad = bad[:-1]
    for i, d in sorted(rows + [(i, None) for i in bad], key=lambda x: x[0]):
        try:
            if not isinstance(d, dict) or "phase" not in d:
                raise ValueError("not JSON" if d is None else "not a phase record")
            out.append(PhaseRecord.from_json(d))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise UserError(f"{path} line {i} is not a memory record ({e}). The file is damaged (a run killed "
                            "mid-write leaves a partial last line): delete that line and rerun.",
                            title="damaged memory records") from None
    if not out:
        raise UserError(f"{path} is empty: the run stopped before its first step finished. Run at least one "
                        "step (`rl train trainer.total_steps=1 ...`) or estimate with `rl mem-report --estimate`.",
                        title="no memory records")
    return out


def _read_run_config(run_dir: Path):
    """(RunConfig or None, note)."""
    f = run_dir / "config.yaml"
    if not f.is_file():
        return None, f"{run_dir} has no config.yaml, so there is no estimate to compare with"
    try:
        from engine import yaml_safe
        from engine.config.load import config_from_dict

        return config_from_dict(yaml_safe.safe_load(f.read_text(), str(f))), ""
    except UserError as e:
        return None, f"config.yaml could not be rebuilt ({e.message}); no estimate"
    except Exception as e:  # noqa: BLE001 - unreadable YAML: report the measurements anyway
        return None, f"config.yaml is unreadable ({type(e).__name__}: {e}); no estimate"


def _metrics_rows(run_dir: Path) -> list[dict]:
    from engine.user_paths import read_jsonl

    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    return [row for _, row in read_jsonl(f, str(f))[0] if isinstance(row, dict)]


def _first_training_rollouts(records: list[PhaseRecord], rank: int = 0) -> list[PhaseRecord]:
    """Rank's first rollout record of each step (later ones in a step are validation rollouts)."""
    out, seen = [], set()
    for r in records:
        if r.phase == "rollout" and r.rank == rank and r.step not in seen and r.step > 0:
            seen.add(r.step)
            out.append(r)
    return out


def observed_seq_len(cfg, records: list[PhaseRecord], metrics: list[dict],
                     config_estimate=None) -> tuple[Optional[int], str, str]:
    """The longest (padded) sequence of the run's training micro-batches on rank 0, as well as
    it can be known: (tokens or None, source, explanation). See the module docstring.
    ``config_estimate``: the estimate at the config's longest sequence, if already built."""
    lengths = [s[-1] for row in metrics for s in (row.get("micro_batch_shapes") or [])
               if isinstance(row.get("micro_batch_shapes"), list) and isinstance(s, list) and s
               and isinstance(s[-1], int) and not isinstance(s[-1], bool)
               and 0 < s[-1] < 2**31]  # a damaged row is skipped (10**400 tokens overflowed the estimate)
    if lengths:
        t = max(lengths)
        return t, "metrics", f"the run's micro-batches (metrics.jsonl micro_batch_shapes, longest {t} tokens)"
    if cfg is None or cfg.rollout.name != "torch":
        return None, "config", ""
    rollouts = [r for r in _first_training_rollouts(records) if r.categories.get("kv_cache")]
    if not rollouts:
        return None, "config", ""
    # KV bytes per token position for all the sequences one rollout generates at once, from the
    # estimate's own KV formula (same dims, dtype, layout)
    base = config_estimate if config_estimate is not None else _estimate(cfg, None, 0)
    per_pos = base.per_rank.get("kv_cache", 0) / max(1, base.assumptions["seq_len"])
    if per_pos <= 0:
        return None, "config", ""
    lens = [r.categories["kv_cache"] / per_pos for r in rollouts]
    if any(abs(x - round(x)) > 0.01 for x in lens):   # not a whole number: different batch sizes
        return None, "config", ""
    t = int(round(max(lens)))
    if cfg.engine.pad_to_length and cfg.engine.pad_to_length_bucket > 1:
        t = math.ceil(t / cfg.engine.pad_to_length_bucket) * cfg.engine.pad_to_length_bucket
    return t, "kv_cache", (f"the rollout's KV cache on rank 0 ({t} tokens: longest prompt + response; "
                           "training rows are at most one token longer)")


def report_from_run(run_dir, device_memory: Union[None, int, str] = None) -> MemoryReportWithNotes:
    """Estimate beside measured for a run directory that holds memory.jsonl (see module doc)."""
    dev = device_memory_bytes(device_memory)
    root, records_path, notes = _run_paths(run_dir)
    records = _load_records(records_path, notes)
    cfg, why = _read_run_config(root)
    if why:
        notes.append(why)
    if dev is None:
        totals = [r.device_total for r in records if r.device_total]
        dev = max(totals) if totals else None
    est, seq_len, source = None, None, "config"
    if cfg is not None:
        try:
            worst = _estimate(cfg, None, dev)
            seq_len, source, how = observed_seq_len(cfg, records, _metrics_rows(root), worst)
            est = _estimate(cfg, seq_len, dev) if seq_len is not None else worst
            if seq_len is not None:
                from engine.batching.validate import MULTI_TURN_LENGTH, SINGLE_TURN_LENGTH
                from engine.config.lengths import is_multi_turn, longest_sequence

                made_of = (MULTI_TURN_LENGTH if is_multi_turn(cfg) else SINGLE_TURN_LENGTH)[0]
                notes.append(f"estimate built at sequence length {seq_len}, from {how}; the config allows up to "
                             f"{longest_sequence(cfg)} ({made_of})")
                if worst.peak_bytes > est.peak_bytes:
                    notes.append(f"at that longest length the per-rank peak would be {_gib(worst.peak_bytes)} "
                                 f"({worst.peak_phase}) instead of {_gib(est.peak_bytes)}")
            else:
                notes.append("the run's sequence length is not recorded (no micro_batch_shapes in metrics.jsonl, "
                             "no KV cache record); activations and logits are estimated at the config's longest "
                             "sequence, so expect them above the measured figures")
        except UserError as e:
            notes.append(f"no estimate: {e.message}")
            est = None
    rep = build_report(str(root), est, records)
    steps = rep.steps
    if steps == [1]:
        notes.append("one step measured: optimizer state is created by the first optimizer step, so phases "
                      "before the update show none of it")
    if any(r.phase == "rollout" for r in records) and len([r for r in records if r.phase == "rollout"
                                                           and r.rank == 0]) > len(steps):
        notes.append("validation rollouts are recorded as rollout phases too; measured rollout peaks include them")
    ranks = sorted({r.rank for r in records})
    if len(ranks) > 1:
        notes.append(f"{len(ranks)} ranks recorded; the comparison is for rank 0 (every rank: --json, measured)")
    return MemoryReportWithNotes(**{f: getattr(rep, f) for f in rep.__dataclass_fields__},
                                 notes=notes, seq_len=seq_len, seq_len_source=source if est else "",
                                 run_dir=str(root))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= (1 << 30) / 10 else f"{n / (1 << 20):.2f} MiB"


def _estimate(cfg, seq_len: Optional[int], device_memory: Optional[int]):
    from engine.memory.estimate import estimate_memory

    return estimate_memory(cfg, seq_len=seq_len, device_memory_bytes=device_memory)


# ---- one step of a job -----------------------------------------------------------------------
def _check_not_reserved(overrides: list[str]) -> None:
    from engine.config.load import parse_override

    for o in overrides:
        _, key, _ = parse_override(o)
        if key in _RESERVED_KEYS:
            raise ConfigError(
                f"`{o}`: rl mem-report sets {key} itself (it runs one step in a temporary directory and saves "
                f"nothing). To report a longer run, run it with `rl train ...` and then `rl mem-report <run dir>`.",
                title="key set by mem-report")


def check_one_step(overrides: Optional[list[str]] = None, engine: Optional[str] = None,
                   device_memory: Union[None, int, str] = None):
    """Validate what ``measure_default`` would run (overrides, engine, --device-memory) without
    running it; returns the composed RunConfig. Raises ConfigError like measure_default."""
    from engine.config.load import load_run_config

    overrides = list(overrides or [])
    device_memory_bytes(device_memory)
    _check_not_reserved(overrides)
    return load_run_config(overrides + list(ONE_STEP_OVERRIDES), engine=engine).config


# ---- estimate only ---------------------------------------------------------------------------
def estimate_only(overrides: Optional[list[str]] = None, engine: Optional[str] = None,
                  device_memory: Union[None, int, str] = None) -> MemoryReportWithNotes:
    """The estimate for a config (meta-device model: no weights, no GPU, nothing downloaded)."""
    from engine.config.load import load_run_config

    dev = device_memory_bytes(device_memory)
    cfg = load_run_config(list(overrides or []), engine=engine).config
    est = _estimate(cfg, None, dev)
    rep = build_report("estimate", est, [])
    notes = []
    if est.device_memory_bytes is None:
        notes.append("no device size: give --device-memory (e.g. 80GiB) for fits / doesn't fit")
    return MemoryReportWithNotes(**{f: getattr(rep, f) for f in rep.__dataclass_fields__}, notes=notes,
                                 seq_len=est.assumptions.get("seq_len"), seq_len_source="config")


__all__ = ["MemoryReportWithNotes", "ONE_STEP_OVERRIDES", "check_one_step", "device_memory_bytes", "estimate_only",
           "observed_seq_len", "report_from_run"]
