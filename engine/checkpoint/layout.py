"""Where checkpoints live on disk and which are complete (docs/checkpoint-format.md).

The one definition of the layout's names, used by engine/checkpoint (save, find, verify),
engine/inspect/rl_checkpoint.py and TAB completion (rlcli/completion_keys.py: this module is
standard library only, so it is cheap on every keystroke).

A step directory is complete iff its manifest.json exists; "latest" is always derived from
the disk, never from a pointer file that can go stale.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine import json_safe

STEP_PREFIX = "step_"
STEP_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-step_"
TMP_STEP_RE = re.compile(r"^\.tmp-step_(\d+)$")
# left behind by the writer: a same-named leftover moved aside by a save, a prune in progress
ASIDE_RE = re.compile(r"^\.(?:stale-step_(\d+)-\d+|deleting-step_(\d+))$")
MANIFEST = "manifest.json"
RUN_FILE = "run.json"
TRAINER_FILE = "trainer.json"
ROLLOUT_QUEUE_FILE = "rollout_queue.pt"  # trainer.mode=one_step_off|async: the rollouts sampled ahead
STATE_DIR = "state"
RNG_DIR = "rng"
RNG_FILE_RE = re.compile(r"^rank_(\d+)\.pt$")             # inside rng/
RNG_PATH_RE = re.compile(r"^rng/rank_(\d+)\.pt$")          # relative to the step dir
DCP_DATA_PATH_RE = re.compile(r"^state/__(\d+)_\d+\.distcp$")  # relative to the step dir: rank R's shard
# `rl export`'s default outputs inside a step (and their staging siblings while one is written):
# never read by resume or inspect, so verification does not count them as checkpoint files
EXPORT_DIRS = ("hf", "hf-adapter")
EXPORT_STAGING_RE = re.compile(r"^\.(?:hf|hf-adapter)\.(?:tmp|old)-")
FORMAT = "rl-checkpoint"
RUN_FORMAT = "rl-run"
VERSION = 1               # run.json's format version
CHECKPOINT_VERSION = 2    # manifest.json: 2 = content hashes and a manifest digest; 1 = sizes only
READABLE_CHECKPOINT_VERSIONS = (1, 2)


def rng_file_name(rank: int) -> str:
    return f"rank_{rank}.pt"


def rng_relpath(rank: int) -> str:
    """Rank ``rank``'s RNG file relative to the step dir, as the manifest lists it."""
    return f"{RNG_DIR}/{rng_file_name(rank)}"


@dataclass(frozen=True)
class StepDir:
    """One step directory (complete ``step_N``, or a save's ``.tmp-step_N``) and every path in it:
    the only place those paths are spelled (tests/test_checkpoint_layout.py keeps it so)."""

    path: Path
    step: int

    @classmethod
    def at(cls, path: "Path | str") -> "StepDir":
        """A step dir known only by its path: the step from its name (``step_N``,
        ``.tmp-step_N``), -1 when the name carries none (the manifest has the step)."""
        path = Path(path)
        step = step_from_name(path.name)
        return cls(path, -1 if step is None else step)

    @property
    def state(self) -> Path:
        """The torch.distributed.checkpoint directory (.metadata + *.distcp)."""
        return self.path / STATE_DIR

    @property
    def rng(self) -> Path:
        return self.path / RNG_DIR

    def rng_file(self, rank: int) -> Path:
        return self.rng / rng_file_name(rank)

    def rng_files(self) -> list[Path]:
        """The rank files present in rng/, by rank (other names there are not rank files)."""
        try:
            found = [(int(m.group(1)), p) for p in self.rng.iterdir() if (m := RNG_FILE_RE.match(p.name))]
        except OSError:  # no rng/ (or not a directory)
            return []
        return [p for _rank, p in sorted(found)]

    @property
    def trainer_json(self) -> Path:
        return self.path / TRAINER_FILE

    @property
    def rollout_queue(self) -> Path:
        """The batches sampled ahead of the next steps and the rollout worker's generator
        (trainer.mode=one_step_off|async; absent in sync runs)."""
        return self.path / ROLLOUT_QUEUE_FILE

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def relative(self, p: Path) -> str:
        """``p`` inside this step dir as the manifest's files table spells it (``rng/rank_0.pt``)."""
        return Path(p).relative_to(self.path).as_posix()

    @property
    def complete(self) -> bool:
        return self.manifest_path.is_file()

    def manifest(self) -> dict:
        return json_safe.loads(self.manifest_path.read_text())


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def step_from_name(name: str) -> int | None:
    """The step of ``step_N``, ``.tmp-step_N``, ``.stale-step_N-<t>`` or ``.deleting-step_N``."""
    m = STEP_RE.match(name) or TMP_STEP_RE.match(name) or ASIDE_RE.match(name)
    if not m:
        return None
    return int(next(g for g in m.groups() if g is not None))


def list_steps(run_dir: Path) -> list[StepDir]:
    """Every step_N directory under ``run_dir``, complete or not, by step."""
    if not run_dir.is_dir():
        return []
    out = []
    try:
        children = list(run_dir.iterdir())
    except OSError:
        return []
    for p in children:
        m = STEP_RE.match(p.name)
        # a symlink named step_N (to elsewhere, dangling, or a loop) is never a checkpoint of this run
        if m and not p.is_symlink() and p.is_dir():
            out.append(StepDir(p, int(m.group(1))))
    return sorted(out, key=lambda s: s.step)


def complete_steps(run_dir: Path) -> list[StepDir]:
    return [s for s in list_steps(run_dir) if s.complete]


def latest_complete(run_dir: Path) -> StepDir | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def is_run_dir(path: Path) -> bool:
    return (path / RUN_FILE).is_file() or bool(list_steps(path))


def checkpoint_holding(path: Path) -> Path | None:
    """The saved checkpoint (a step_N, or an unfinished .tmp-step_N, of a run) that ``path`` is or
    lies inside, if any."""
    p = Path(os.path.abspath(path))
    for d in (p, *p.parents):
        if (STEP_RE.match(d.name) or TMP_STEP_RE.match(d.name)) and \
                ((d / MANIFEST).exists() or (d.parent / RUN_FILE).exists()):
            return d
    return None


def manifest_file_problems(step_dir: Path, manifest: dict) -> list[str]:
    """Every file the manifest lists must exist with its recorded size; what does not."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        return []
    problems = []
    for rel, size in files.items():
        p = step_dir / rel
        if not p.is_file():
            problems.append(f"{rel} is missing (listed in {MANIFEST})")
        elif isinstance(size, int) and p.stat().st_size != size:
            problems.append(f"{rel} is {p.stat().st_size:,} bytes, {MANIFEST} says {size:,}")
    return problems


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and stale temp dirs.
    Incomplete step_N dirs are left alone (someone may be inspecting them)."""
    removed = []
    for p in run_dir.glob(TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    if keep_last > 0:
        for s in complete_steps(run_dir)[:-keep_last]:
            # rename first so a crash mid-delete never leaves a half checkpoint named step_N
            doomed = run_dir / f".deleting-{s.path.name}"
            os.replace(s.path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(s.path)
    return removed
