"""Around every run (`rl train`, `rl resume`): preflight, the run-directory lock, and what a
failure leaves behind.

    with guarded_run(cfg, run_dir, overrides=..., resume=plan, env_refs=..., on_event=...) as (rdir, inputs):
        ...the training loop...

- preflight first (engine.trainer.preflight): nothing is created when it fails;
- the lock (engine.trainer.run_lock) is held until the run ends, however it ends;
- leftovers of interrupted saves and prunes (.tmp-step_N, .stale-step_N-*, .deleting-step_N)
  that nothing wrote into since the lock was taken are removed, with a Notice
  (engine/checkpoint/leftovers.py);
- a new run that fails before its first metrics row or checkpoint removes everything it
  created (a retry with the same checkpoint.dir is never blocked by it);
- a failed write (disk full, read-only file system, permissions), on the driver or on a rank,
  stops the run with one paragraph naming the last complete checkpoint, which is intact; the
  unfinished `.tmp-step_N` is removed.
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from engine.checkpoint.layout import TMP_PREFIX, complete_steps, latest_complete
from engine.checkpoint.leftovers import describe_removed, remove_leftovers
from engine.config.schema import RunConfig
from engine.errors import UserError
from engine.events import Notice
from engine.trainer.io_errors import describe_os_error, disk_error_in, file_system_problem
from engine.trainer.preflight import preflight
from engine.trainer.run_dir import RunDir
from engine.trainer.run_lock import RunLock


class RunStoppedOnDiskError(UserError):
    """A write failed during the run; the last complete checkpoint is intact."""


def _entries(path: Path) -> set[str]:
    try:
        return {p.name for p in path.iterdir()}
    except OSError:
        return set()


def _check_plan_current(resume, run_dir: Path) -> None:
    """Under the lock: the checkpoints the resume was planned against are still what is on disk
    (another writer may have finished steps between planning and locking)."""
    newer = [s.path.name for s in complete_steps(run_dir) if s.step > resume.step]
    if not Path(resume.step_dir).is_dir() or sorted(newer) != sorted(resume.later_checkpoints):
        raise UserError(f"{run_dir}/ changed while this resume was being planned (now: "
                        f"{', '.join(newer) or 'no newer checkpoint'}; another rl process wrote it). Nothing was "
                        f"modified; run the command again.", title="run directory changed")


def _stopped_message(run_dir: Path, err: OSError) -> str:
    latest = latest_complete(run_dir)
    where = (f"The last complete checkpoint is {latest.path} (step {latest.step}), intact: continue with "
             f"`rl resume {run_dir}` once the problem is fixed." if latest else
             "No checkpoint had been saved yet; start again once the problem is fixed.")
    return f"The run stopped: writing to {run_dir}/ failed: {describe_os_error(err)}. {where}"


def _remove_unfinished_saves(run_dir: Path) -> None:
    """The unfinished checkpoint and the temp files of atomic rewrites (e.g. metrics.jsonl.tmp
    from resume's truncation): never data, and they hold the space a full disk needs."""
    for p in run_dir.glob(TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in run_dir.glob("*.tmp"):
        try:
            p.unlink()
        except OSError:
            pass


def _remove_created(run_dir: Path, before: set[str], created_dir: bool) -> None:
    for name in _entries(run_dir) - before:
        p = run_dir / name
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:
            pass
    if created_dir:
        try:
            run_dir.rmdir()  # only if empty
        except OSError:
            pass


@contextmanager
def guarded_run(cfg: RunConfig, run_dir: Path, *, overrides: list[str], resume, env_refs: dict | None,
                on_event: Callable[[object], None]):
    run_dir = Path(run_dir)
    report = preflight(cfg, run_dir=run_dir, resume=resume, env_refs=env_refs)
    report.raise_if_failed()
    lock = RunLock(run_dir)
    before = _entries(run_dir)
    locked_at = time.time()
    lock.acquire()
    rdir = RunDir(run_dir)
    failed = False
    try:
        if lock.note:
            on_event(Notice(lock.note))
        for note in report.notes:
            on_event(Notice(note))
        if resume is None:
            rdir.create(cfg, overrides, overwrite=cfg.checkpoint.overwrite, env_refs=env_refs)
        else:
            _check_plan_current(resume, run_dir)
            rdir.load_env_refs(resume.overrides)
        removed, _kept = remove_leftovers(run_dir, older_than=locked_at)  # only what no one wrote since the lock
        if removed:
            on_event(Notice(describe_removed(run_dir, removed)))
        yield rdir, report.inputs
    except BaseException as e:
        failed = True
        err = None
        # a stop the user asked for (Ctrl-C; SIGTERM's SystemExit(143), engine/sigterm.py) is not a
        # disk error, even when it lands while an OSError is being handled (a stat of a .tmp-step_N
        # that a save had just renamed), which its __context__ then carries
        if not isinstance(e, (UserError, KeyboardInterrupt, SystemExit)):
            err = disk_error_in(e) or file_system_problem(run_dir, report.estimated_checkpoint_bytes)
        if err is not None:
            _remove_unfinished_saves(run_dir)
            raise RunStoppedOnDiskError(_stopped_message(run_dir, err), title="run stopped: write failed") from None
        raise
    finally:
        lock.release()
        if failed and resume is None and not rdir.has_progress():
            _remove_created(run_dir, before, lock.created_dir)
