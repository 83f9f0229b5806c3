"""Open a dataset through the `datasets` library, offline.

``task.path`` may be a Parquet / JSONL / JSON / Arrow / CSV file, a ``save_to_disk`` directory
(a Dataset or a DatasetDict), a directory of data files (splits named by file, e.g.
``train.parquet`` / ``test.parquet``), or the name of a dataset in the local Hugging Face cache
(``openai/gsm8k`` with ``task.subset=main``): prepared in the `datasets` cache, or a hub-cache
snapshot. Nothing is downloaded.
"""

from __future__ import annotations

import difflib
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv"}
TASK_BUILDERS = {"jsonl": "json", "parquet": "parquet"}  # task=jsonl|parquet with another file extension
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")    # text formats compressed: `datasets` reads them as they are


def data_suffix(p: Path) -> str:
    """The data format's extension: ``x.jsonl`` -> ``.jsonl``, and under a compression suffix
    ``x.jsonl.gz`` -> ``.jsonl`` (``.parquet``/``.arrow`` are never compressed this way)."""
    suffixes = [x.lower() for x in p.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in COMPRESSIONS and suffixes[-2] in (".jsonl", ".json", ".csv"):
        return suffixes[-2]
    return p.suffix.lower()


@dataclass
class OpenedDataset:
    splits: dict            # split name -> datasets.Dataset
    source: str             # what was opened, for messages
    kind: str               # "file", "save_to_disk", "directory" or "hf_cache"


def _datasets():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ConfigError("Loading a dataset needs the `datasets` library: pip install 'rl[data]'.",
                          title="missing dependency") from None
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    return datasets


def _as_splits(obj, default: str) -> dict:
    if isinstance(obj, dict):  # a DatasetDict
        return dict(obj)
    return {default: obj}


def _unreadable(what: str, e: Exception, fix: str) -> ConfigError:
    # `datasets` wraps the parser's error (DatasetGenerationError "An error occurred while generating the
    # dataset"): the cause says what is wrong and where (pyarrow's "JSON parse error: ... in row 1")
    while e.__cause__ is not None and isinstance(e.__cause__, Exception):
        e = e.__cause__
    msg = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    return ConfigError(f"Cannot read {what}: {type(e).__name__}: {msg[:300]}. {fix}", title="invalid dataset")


def _no_rows(p: Path, builder: str) -> str:
    """Why a JSON/JSONL/CSV file holds no rows ("" when it has some): empty or blank, only a CSV
    header, ``[]`` (``datasets`` then fails with StopIteration or 'corresponds to no data'). Reads
    at most a few lines."""
    if builder not in ("json", "csv"):
        return ""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(p.suffix.lower(), open)
    lines = []
    try:
        with opener(p, "rt", encoding="utf-8-sig", errors="replace") as f:
            for line in f:
                if line.strip():
                    lines.append(line.strip())
                if len(lines) > 1:
                    return ""
    except (OSError, EOFError, lzma.LZMAError):
        return ""
    if not lines:
        return "the file is empty"
    if builder == "csv":
        return "it holds only a header line"
    if lines[0] == "{}":  # an object with no keys: not one row, and no list of rows
        row = '{"prompt": ..., "answer": ...}'
        how = (f"a JSON Lines file holds one row per line, each an object such as `{row}`"
               if ".jsonl" in p.name.lower() else
               f"a JSON file holds a list of rows, `[{row}, ...]` (or use JSON Lines: one such object per line)")
        return f"it holds an empty JSON object (`{{}}`), not rows: {how}"
    return "it is an empty JSON list (`[]`)" if lines[0] == "[]" else ""


def _utf16(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(head) == 4 and (head[1::2] == b"\0\0" or
                                                                           head[0::2] == b"\0\0"))


_METADATA_JSON = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")


def _ignored_files(datasets, root: Path) -> list[str]:
    """Data files under ``root`` (by extension) that `load_dataset(root)` does not read: once some
    files are named by split (train.parquet), the others are skipped silently."""
    try:
        used = {os.path.realpath(f) for files in datasets.load_dataset_builder(str(root)).config.data_files.values()
                for f in files}
    except Exception:  # noqa: BLE001 - the dataset loaded; this check only adds a refusal
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            full = Path(dirpath) / f
            if f.startswith(".") or f in _METADATA_JSON or BUILDERS.get(data_suffix(full)) is None:
                continue
            if os.path.realpath(full) not in used:
                out.append(str(full.relative_to(root)))
    return out


def looks_like_name(path: str) -> bool:
    return not path.startswith((".", "/", "~")) and data_suffix(Path(path)) not in BUILDERS and \
        path.count("/") <= 1 and all(p for p in path.split("/"))


def cache_dirs() -> list[str]:
    ds = _datasets()
    from huggingface_hub import constants

    return [str(ds.config.HF_DATASETS_CACHE), str(constants.HF_HUB_CACHE)]


def open_dataset(path: str, *, task_name: str = "dataset", subset: str = "", split: str = "train") -> OpenedDataset:
    _datasets()  # imported first: its import sets its logger's level
    with _library_log_quiet():
        return _open_dataset(path, task_name=task_name, subset=subset, split=split)


@contextmanager
def _library_log_quiet():
    """`datasets` logs a file it cannot parse ("Failed to load JSON from file ... ArrowInvalid ...",
    "Failed to read schema from ...") on stderr, then raises; rl's error from what it raised says the
    same, with the fix. Its log is silenced while it opens the data, and put back as it was."""
    import logging

    lib = logging.getLogger("datasets")
    level = lib.level
    lib.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        lib.setLevel(level)


def _open_dataset(path: str, *, task_name: str, subset: str, split: str) -> OpenedDataset:
    datasets = _datasets()
    p = Path(os.path.expanduser(path))
    from engine.user_paths import file_kind, shown, stat_path

    st = stat_path(p, f"`task.path={shown(path)}`", error=ConfigError, title="invalid config value")
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # a FIFO, /dev/zero: never read
        raise ConfigError(f"`task.path={path}` is {file_kind(st)}, not a data file; it is not read. Give a "
                          "Parquet/JSONL/JSON/Arrow file, a save_to_disk directory, or a dataset name in the local "
                          "Hugging Face cache.", title="invalid config value")
    if p.is_file():
        builder = BUILDERS.get(data_suffix(p)) or TASK_BUILDERS.get(task_name)
        if builder is None:
            raise ConfigError(f"`task.path={path}`: cannot tell the format of `{p.name}` from its extension; use "
                              f"one of {', '.join(BUILDERS)} (JSONL/JSON/CSV may be compressed: "
                              f"{', '.join('.jsonl' + c for c in COMPRESSIONS[:3])}, ...).", title="invalid dataset")
        try:
            d = datasets.load_dataset(builder, data_files={split: str(p)})
        except Exception as e:  # noqa: BLE001 - datasets/pyarrow raise many types for a malformed file
            why = _no_rows(p, builder)
            if why:
                raise ConfigError(f"`task.path={path}` has no rows: {why}. Point task.path at the file that holds "
                                  f"your prompts, or fill it in (one row per prompt).",
                                  title="invalid dataset") from None
            if builder in ("json", "csv") and _utf16(p):
                raise ConfigError(f"`task.path={path}` is UTF-16 text; JSON/JSONL/CSV are read as UTF-8. Save it as "
                                  f"UTF-8 (e.g. `iconv -f UTF-16 -t UTF-8 {p.name} > {p.stem}.utf8{p.suffix}`).",
                                  title="invalid dataset") from None
            raise _unreadable(str(p), e, f"Check that it is valid {builder.upper()}.") from None
        return OpenedDataset(_as_splits(d, split), str(p), "file")
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            try:
                d = datasets.load_from_disk(str(p))
            except Exception as e:  # noqa: BLE001
                raise _unreadable(f"the saved dataset {p}", e, "Re-save it with Dataset.save_to_disk.") from None
            return OpenedDataset(_as_splits(d, split), str(p), "save_to_disk")
        try:
            d = datasets.load_dataset(str(p))
        except Exception as e:  # noqa: BLE001
            raise _unreadable(f"the directory {p}", e, "Point task.path at a data file, a save_to_disk directory, "
                              "or a directory of Parquet/JSONL files named by split (train.parquet, "
                              "test.parquet).") from None
        ignored = _ignored_files(datasets, p)
        if ignored:
            raise ConfigError(f"`task.path={path}`: `datasets` reads this directory's files named by split "
                              f"({', '.join(sorted(str(k) for k in d))}) and would skip "
                              f"{', '.join(ignored[:5])}{', ...' if len(ignored) > 5 else ''}: their rows would not "
                              f"be trained on. Name every data file by its split, in one format (train.jsonl, "
                              f"test.jsonl; several for a split as train-00000-of-00002.jsonl, ...), move the others "
                              f"out, or point task.path at one file.", title="invalid dataset")
        return OpenedDataset(_as_splits(d, split), str(p), "directory")
    if looks_like_name(path):
        return _open_cached(datasets, path, subset)
    raise ConfigError(f"`task.path={path}` does not exist. Give a Parquet/JSONL/JSON/Arrow file, a save_to_disk "
                      f"directory, or a dataset name in the local Hugging Face cache.", title="invalid config value")


def _open_cached(datasets, name: str, subset: str) -> OpenedDataset:
    """A dataset prepared earlier by `load_dataset(name)` (the datasets cache), else the files of
    a hub snapshot (`huggingface-cli download --repo-type dataset name`), both offline."""
    shown = f"{name}{':' + subset if subset else ''}"
    try:
        d = datasets.load_dataset(name, subset or None)
        return OpenedDataset(_as_splits(d, "train"), f"{shown} (HF datasets cache)", "hf_cache")
    except Exception as e:  # noqa: BLE001 - offline misses surface as several exception types
        first = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and friends: not in the hub cache either
        where = " and ".join(cache_dirs())
        raise ConfigError(
            f"`task.path={name}` is not a file or directory here, and no dataset `{name}`"
            f"{f' (subset {subset})' if subset else ''} is in the local Hugging Face cache (looked in {where}; "
            f"offline, nothing is downloaded; datasets said {first}). Download it once elsewhere and copy the "
            f"cache, or save it with `save_to_disk` and pass that directory.", title="dataset not found") from None
    try:
        d = datasets.load_dataset(snapshot, subset or None)
    except Exception as e:  # noqa: BLE001
        raise _unreadable(f"the cached snapshot of {name} ({snapshot})", e, "Pass task.subset=<config> if the "
                          "dataset has several, or point task.path at one of its files.") from None
    return OpenedDataset(_as_splits(d, "train"), f"{shown} (HF hub cache)", "hf_cache")


def pick_split(opened: OpenedDataset, split: str, key: str):
    if split in opened.splits:
        return opened.splits[split]
    names = list(opened.splits)
    close = difflib.get_close_matches(split, names, n=1)
    hint = f" Did you mean `{key}={close[0]}`?" if close else ""
    raise ConfigError(f"`{key}={split}`: {opened.source} has no split `{split}`.{hint} Splits: "
                      f"{', '.join(names)}.", title="invalid config value")
