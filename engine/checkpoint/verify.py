"""Is a step directory exactly what its save wrote? (`rl resume`, `rl inspect-ckpt --verify`)

Four layers, each cheap except the third, which reads every byte once:

1. **structure** (always): every path under the step directory is a plain directory or a
   regular file (no symlink, FIFO, device), every file is listed in the manifest, every
   listed file exists with its recorded size;
2. **manifest digest** (manifest version 2): the manifest's own BLAKE2b over all its other
   fields, so an edited field (step, coverage, a hash) is detected;
3. **content** (skipped by ``--no-verify``): each file's BLAKE2b-256 against the manifest;
4. **consistency** (always): the manifest against the shards and trainer.json: step numbers
   agree; the data position is inside the dataset and adds up (samples_seen = epoch x n +
   index = step x train_batch_size); optimizer coverage matches the DCP entries (FSDP never
   writes state for a parameter the manifest says had none); one RNG file per rank that
   existed at save and none for ranks that did not.

Manifests of version 1 (written before content hashes existed) have no hashes: layers 1 and 4
still run, 2 and 3 cannot, and the result says so (``legacy``); see docs/security.md.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from engine.checkpoint.digest import ALGORITHMS, MANIFEST_DIGEST_KEY, hash_file, manifest_digest
from engine.checkpoint.layout import DCP_DATA_PATH_RE as _DATA_FILE
from engine.checkpoint.layout import (EXPORT_DIRS, EXPORT_STAGING_RE, MANIFEST, STATE_DIR, STEP_RE, TRAINER_FILE,
                                      StepDir, rng_relpath)
from engine.checkpoint.layout import RNG_PATH_RE as _RNG_FILE
from engine.errors import CheckpointError
_SHOWN = 8


@dataclass
class Verification:
    """What was checked, for the tables and --json."""

    step_dir: str
    content: bool = False          # every file's hash was compared
    legacy: bool = False           # a version-1 manifest: no hashes to compare
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    algorithm: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def summary(self) -> str:
        size = f"{self.bytes / 2**20:,.1f} MiB"
        if self.legacy:
            return (f"sizes only: {self.files} files, {size} (a version-1 manifest records no content hashes)")
        if not self.content:
            return f"NOT verified (--no-verify): sizes only, {self.files} files, {size}"
        rate = f", {self.bytes / 2**30 / self.seconds:.2f} GiB/s" if self.seconds > 0 and self.bytes > 2**26 else ""
        return f"{self.files} files, {size}, {self.algorithm} in {self.seconds:.2f} s{rate}"

    def to_json(self) -> dict:
        return {"step_dir": self.step_dir, "content": self.content, "legacy": self.legacy, "files": self.files,
                "bytes": self.bytes, "seconds": round(self.seconds, 4), "algorithm": self.algorithm,
                "problems": list(self.problems)}


def verify_step(step_dir: Path, manifest: dict, *, content: bool = True) -> Verification:
    """Check ``step_dir`` against ``manifest`` (all four layers; content unless ``content`` is
    false). Returns the result with ``problems``; never raises for a damaged checkpoint."""
    t0 = time.perf_counter()
    step_dir = Path(step_dir)
    v = Verification(step_dir=str(step_dir))
    version = manifest.get("version")
    hashes_block = manifest.get("hashes")
    v.legacy = version == 1 and hashes_block is None and MANIFEST_DIGEST_KEY not in manifest

    listed = _listed_files(manifest, v.problems)
    on_disk = _walk(step_dir, v.problems)
    for rel in sorted(set(on_disk) - set(listed) - {MANIFEST}):
        v.problems.append(f"{rel} is not listed in {MANIFEST} (a file the save did not write: move it out)")
    for rel, size in sorted(listed.items()):
        if rel not in on_disk:
            v.problems.append(f"{rel} is missing (listed in {MANIFEST})")
        elif isinstance(size, int) and on_disk[rel] != size:
            v.problems.append(f"{rel} is {on_disk[rel]:,} bytes, {MANIFEST} says {size:,}")
    v.files = len(listed)
    v.bytes = sum(s for s in listed.values() if isinstance(s, int))

    hashes: dict = {}
    if not v.legacy:
        if manifest.get(MANIFEST_DIGEST_KEY) != manifest_digest(manifest):
            v.problems.append(f"{MANIFEST} was edited after it was written (its digest does not match its "
                              f"contents)" if MANIFEST_DIGEST_KEY in manifest else
                              f"{MANIFEST} has no {MANIFEST_DIGEST_KEY!r} although it is version {version!r}")
        if not isinstance(hashes_block, dict) or hashes_block.get("algorithm") not in ALGORITHMS or \
                not isinstance(hashes_block.get("files"), dict):
            v.problems.append(f"{MANIFEST} records no content hashes ({' or '.join(ALGORITHMS)}) although it is "
                              f"version {version!r}")
        else:
            hashes = hashes_block["files"]
            v.algorithm = hashes_block["algorithm"]
            for rel in sorted(set(listed) ^ set(hashes)):
                v.problems.append(f"{rel} has a size but no hash in {MANIFEST}" if rel in listed else
                                  f"{MANIFEST} has a hash for {rel} but does not list it")
    if content and not v.legacy and not v.problems:
        v.content = True
        for rel in sorted(listed):
            want = hashes.get(rel)
            try:
                _n, got = hash_file(step_dir / rel, v.algorithm)
            except OSError as e:
                v.problems.append(f"{rel} cannot be read ({e.strerror or e})")
                continue
            if got != want:
                v.problems.append(f"{rel} content differs from what was written ({v.algorithm} {got[:16]}..., "
                                  f"{MANIFEST} says {str(want)[:16]}...)")

    if not v.problems:  # consistency only on files that are what was written
        v.problems += consistency_problems(step_dir, manifest)
    v.seconds = time.perf_counter() - t0
    return v


def raise_if_corrupt(v: Verification, hint: str = "") -> None:
    if v.problems:
        shown = v.problems[:_SHOWN] + ([f"and {len(v.problems) - _SHOWN} more"] if len(v.problems) > _SHOWN else [])
        raise CheckpointError(
            f"{v.step_dir} does not match its manifest: {'; '.join(shown).rstrip('.')}. The checkpoint was damaged or "
            f"edited after it was written; nothing was loaded or changed.{hint}", title="corrupt checkpoint")


# ---- layer 1 ------------------------------------------------------------------------------
def _listed_files(manifest: dict, problems: list[str]) -> dict[str, Any]:
    files = manifest.get("files")
    if not isinstance(files, dict):
        problems.append(f"{MANIFEST} has no 'files' table")
        return {}
    out = {}
    for rel, size in files.items():
        p = PurePosixPath(str(rel))
        if p.is_absolute() or ".." in p.parts or str(p) != str(rel) or rel == MANIFEST:
            problems.append(f"{MANIFEST} lists {rel!r}, which is not a file inside the checkpoint")
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            problems.append(f"{MANIFEST} records size {size!r} for {rel}")
        out[str(rel)] = size
    return out


def _walk(root: Path, problems: list[str]) -> dict[str, int]:
    """{relative path: size} of every regular file under ``root``, never following a link;
    anything else (symlink, FIFO, device, socket, unreadable dir) is a problem."""
    out: dict[str, int] = {}
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError as e:
            problems.append(f"{os.path.relpath(d, root)} cannot be listed ({e.strerror or e})")
            continue
        for e in entries:
            rel = os.path.relpath(e.path, root)
            try:
                st = e.stat(follow_symlinks=False)
            except OSError as err:
                problems.append(f"{rel} cannot be read ({err.strerror or err})")
                continue
            if d == root and stat.S_ISDIR(st.st_mode) and (e.name in EXPORT_DIRS or EXPORT_STAGING_RE.match(e.name)):
                continue  # `rl export`'s default output (step_N/hf): not checkpoint files, never read
            if stat.S_ISLNK(st.st_mode):
                problems.append(f"{rel} is a symbolic link (a save writes only regular files)")
            elif stat.S_ISDIR(st.st_mode):
                stack.append(Path(e.path))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = st.st_size
            else:
                problems.append(f"{rel} is not a regular file (a FIFO, device or socket)")
    return out


# ---- layer 4 ------------------------------------------------------------------------------
def _int(x) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def consistency_problems(step_dir: Path, manifest: dict, trainer: Optional[dict] = None,
                         saved_names: Optional[set[str]] = None) -> list[str]:
    """The manifest against trainer.json and the DCP metadata (read here unless given)."""
    from engine.checkpoint.io.files import read_json

    problems: list[str] = []
    if trainer is None:
        try:
            trainer = read_json(StepDir.at(step_dir).trainer_json, what=f"{step_dir.name}/{TRAINER_FILE}")
        except CheckpointError as e:
            return [e.message]
    if not isinstance(trainer, dict):
        return ["trainer.json is not a JSON object"]
    if saved_names is None:
        from engine.checkpoint.io.dcp import read_dcp

        try:
            c = read_dcp(StepDir.at(step_dir).state, display=f"{step_dir.name}/{STATE_DIR}")
        except CheckpointError as e:
            return [e.message]
        saved_names = {t.name for t in c.tensors} | {o.name for o in c.objects}

    # step
    step = _int(manifest.get("step"))
    m = STEP_RE.match(step_dir.name)
    if step is None or step < 0:
        problems.append(f"{MANIFEST} step is {manifest.get('step')!r}")
    elif m and int(m.group(1)) != step:
        problems.append(f"{MANIFEST} says step {step}, the directory is {step_dir.name}")
    if _int(trainer.get("step")) != step:
        problems.append(f"trainer.json says step {trainer.get('step')!r}, {MANIFEST} says {step!r}")

    # data position
    problems += _data_problems(manifest, trainer, step)

    # optimizer coverage against the shards
    opt = manifest.get("optimizer")
    param_state = opt.get("param_state") if isinstance(opt, dict) else None
    if not isinstance(param_state, dict):
        problems.append(f"{MANIFEST} has no optimizer.param_state table")
    else:
        model = {n[len("model."):] for n in saved_names if n.startswith("model.")}
        unknown = sorted(f for f in param_state if f not in model)
        if unknown:
            problems.append(f"{MANIFEST} records optimizer state for {len(unknown)} parameter(s) the model in "
                            f"state/ does not have: {', '.join(unknown[:4])}")
        bad_values = sorted(f for f, v in param_state.items() if not isinstance(v, bool))
        if bad_values:
            problems.append(f"{MANIFEST} optimizer.param_state must be true/false; not for {', '.join(bad_values[:4])}")
        if manifest.get("engine") == "fsdp":
            # DSD writes optimizer state only for parameters that have it: "false" with state on
            # disk means the manifest is wrong (e.g. edited to reset the optimizer)
            has_state = {f for f in param_state if any(n.startswith(f"optim.state.{f}.") for n in saved_names)}
            contradicted = sorted(f for f, v in param_state.items() if v is False and f in has_state)
            if contradicted:
                problems.append(f"{MANIFEST} says {len(contradicted)} parameter(s) had no optimizer state, but "
                                f"state/ holds it: {', '.join(contradicted[:4])}"
                                + (" ..." if len(contradicted) > 4 else ""))

    # ranks: DCP writers and RNG files against the world size
    ws = _int(manifest.get("world_size"))
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    if ws is None or ws < 1:
        problems.append(f"{MANIFEST} world_size is {manifest.get('world_size')!r}")
    else:
        rng = {int(mm.group(1)) for rel in files if (mm := _RNG_FILE.match(rel))}
        writers = {int(mm.group(1)) for rel in files if (mm := _DATA_FILE.match(rel))}
        lacking = sorted(set(range(ws)) - rng)
        if lacking:
            problems.append(f"{rng_relpath(lacking[0])} is missing although rank {lacking[0]} existed at save "
                            f"(world size {ws})" if len(lacking) == 1 else
                            f"RNG files of ranks {', '.join(map(str, lacking[:8]))} are missing although they "
                            f"existed at save (world size {ws})")
        extra = sorted(r for r in rng | writers if r >= ws)
        if extra:
            problems.append(f"files of rank(s) {', '.join(map(str, extra[:8]))} although the world size at save "
                            f"was {ws}")
    return problems


def _data_problems(manifest: dict, trainer: dict, step: Optional[int]) -> list[str]:
    data = trainer.get("data")
    if not isinstance(data, dict):
        return ["trainer.json has no data position"]
    vals = {k: _int(data.get(k)) for k in ("epoch", "index", "n", "samples_seen")}
    bad = [k for k, x in vals.items() if x is None or x < 0]
    if bad:
        return [f"trainer.json data position has invalid {', '.join(bad)} ({ {k: data.get(k) for k in bad} })"]
    epoch, index, n, seen = vals["epoch"], vals["index"], vals["n"], vals["samples_seen"]
    out = []
    if n == 0:
        out.append("trainer.json says the prompt set is empty (n = 0)")
    elif index > n:
        out.append(f"trainer.json data position is prompt {index:,} of an epoch of {n:,} prompts")
    elif epoch * n + index != seen:
        out.append(f"trainer.json data position does not add up: epoch {epoch:,} x {n:,} prompts + index "
                   f"{index:,} != samples_seen {seen:,}")
    for where, x in ((TRAINER_FILE, trainer.get("samples_seen")), (MANIFEST, manifest.get("samples_seen"))):
        if x != seen:
            out.append(f"{where} samples_seen is {x!r}, the data position says {seen!r}")
    cfg = manifest.get("config")
    bs = _int(((cfg or {}).get("data") or {}).get("train_batch_size")) if isinstance(cfg, dict) else None
    queued = _int(trainer.get("queued_prompts", 0)) or 0  # trainer.mode sampled ahead: drawn, not yet trained
    refilled = bool(((cfg or {}).get("algorithm") or {}).get("dynamic_sampling")) if isinstance(cfg, dict) else False
    if bs and step is not None and (seen < step * bs + queued if refilled else seen != step * bs + queued):
        drawn = f"step {step} x data.train_batch_size {bs}" + (f" + {queued} queued" if queued else "")
        out.append(f"samples_seen {seen:,} is {'below' if refilled else 'not'} {drawn}")
    return out
