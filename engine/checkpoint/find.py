"""Which checkpoint a path means: a run root -> its latest complete step_N (derived from the
disk, never a pointer file); a step_N -> that one. Refuses incomplete and temporary dirs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.layout import MANIFEST, STATE_DIR, STEP_RE, TMP_PREFIX, StepDir, complete_steps, list_steps
from engine.errors import CheckpointError


@dataclass(frozen=True)
class Located:
    run_root: Path
    step: StepDir
    skipped: list[str]          # newer directories that are not complete checkpoints
    later: list[str]            # newer *complete* checkpoints (only when a step_N was named)


_DONE = {"resume": "resumed", "export": "exported"}


def find_checkpoint(path: Path, command: str = "resume") -> Located:
    """A run root -> its latest complete step_N (derived from disk); a step_N -> that one.
    ``command`` (resume, export) is the `rl` command the refusals name in their hints."""
    import stat

    from engine.user_paths import file_kind, shown as shown_path, stat_path

    path = Path(path)
    shown = shown_path(path)
    done_word = _DONE.get(command, "used")
    st = stat_path(path, f"The checkpoint path {shown}", error=CheckpointError, title="no checkpoint")
    if st is None:
        raise CheckpointError(f"{shown} does not exist. Pass a run directory (checkpoint.dir of a run, e.g. "
                              f"`rl {command} ckpt/`) or one of its step_N directories.", title="no checkpoint")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{shown} is {file_kind(st)}, not an rl checkpoint. Pass a run directory (e.g. "
                              f"`rl {command} ckpt/`) or one of its step_N directories.", title="not an rl checkpoint")
    path = path.resolve()
    if path.name.startswith(TMP_PREFIX):
        run_root = path.parent
        latest = latest_hint(run_root, command)
        raise CheckpointError(f"{shown} is a save that never finished (.tmp-step_N directories are never "
                              f"{done_word}).{latest}", title="incomplete checkpoint")
    if STEP_RE.match(path.name):
        run_root = path.parent
        step = StepDir.at(path)
        if not step.complete:
            raise CheckpointError(f"{shown} is incomplete: it has no {MANIFEST} (the save did not finish, or the "
                                  f"directory was copied partially).{latest_hint(run_root, command)}",
                                  title="incomplete checkpoint")
        later = [s.path.name for s in complete_steps(run_root) if s.step > step.step]
        skipped = [s.path.name for s in list_steps(run_root) if s.step > step.step and not s.complete]
        return Located(run_root, step, skipped, later)
    if path.name == STATE_DIR and STEP_RE.match(path.parent.name):
        raise CheckpointError(f"{shown} is the DCP directory inside a checkpoint; pass the step directory "
                              f"itself: `rl {command} {path.parent}`.", title="not an rl checkpoint")
    steps = list_steps(path)
    tmps = sorted(p.name for p in path.glob(TMP_PREFIX + "*"))
    if not steps:
        if (path / "run.json").is_file():
            interrupted = f" An interrupted save ({', '.join(tmps)}) is never {done_word}." if tmps else ""
            raise CheckpointError(
                f"{shown} holds a run that has not written a checkpoint yet (it saves every checkpoint.save_freq "
                f"steps).{interrupted} Nothing can be {done_word}: start it again with `rl train ... "
                f"checkpoint.dir={shown} checkpoint.overwrite=true`.", title="no checkpoint")
        raise CheckpointError(f"{shown} is not an rl checkpoint (no run.json, no step_N/ checkpoints, no {MANIFEST}). "
                              f"Pass the checkpoint.dir of a run, e.g. `rl {command} ckpt/`, or one of its step_N "
                              f"directories.", title="not an rl checkpoint")
    done = [s for s in steps if s.complete]
    if not done:
        names = ", ".join(s.path.name for s in steps)
        raise CheckpointError(
            f"{shown} holds only incomplete checkpoints ({names}: no {MANIFEST}; their saves did not finish). "
            f"None can be {done_word} safely. Start the run again with `rl train ... checkpoint.dir={shown} "
            f"checkpoint.overwrite=true`.", title="incomplete checkpoint")
    chosen = done[-1]
    newer = [s.path for s in steps if s.step > chosen.step]
    if newer:  # a save writes .tmp-step_N and renames it last: a step_N without its manifest was copied or damaged
        names = ", ".join(p.name for p in newer)
        raise CheckpointError(
            f"{shown} has newer checkpoint directories without a {MANIFEST} ({names}). rl's saves never leave one "
            f"(they write .tmp-step_N and rename it once complete), so these were copied partially (an rsync or "
            f"cp still running, or cut short) or damaged. Finish the copy, or pass the latest complete checkpoint "
            f"explicitly: `rl {command} {chosen.path}`{' (a later save of those steps then replaces them)' if command == 'resume' else ''}.",
            title="incomplete checkpoint")
    return Located(path, chosen, tmps, [])


def latest_hint(run_root: Path, command: str = "resume") -> str:
    done = complete_steps(run_root)
    if not done:
        return " There is no complete checkpoint next to it."
    return f" The latest complete checkpoint there is {done[-1].path.name}: `rl {command} {done[-1].path}`."


def earlier_hint(root: Path, step: StepDir, command: str = "resume") -> str:
    earlier = [s for s in complete_steps(root) if s.step < step.step]
    return f" Earlier: `rl {command} {earlier[-1].path}`." if earlier else ""
