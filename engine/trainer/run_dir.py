"""The run directory: resolved config, overrides, versions, metrics and checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from engine.atomic_files import write_json_atomic
from engine.checkpoint.layout import RUN_FORMAT, TMP_PREFIX, VERSION, latest_complete, list_steps, prune
from engine.config.schema import RunConfig
from engine.env_info import package_versions
from engine.errors import UserError
from engine.tracking.jsonl_logger import append_line


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file + fsync + rename; the temp file is removed if the write fails."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# what a run writes at its root (docs/checkpoint-format.md, engine/tracking, engine/checkpoint/run_files.py,
# engine/data/fingerprint.py), besides step_N/ and the directories of unfinished or set-aside saves
RUN_ENTRIES = frozenset({"run.json", "config.yaml", "overrides.yaml", "versions.json", "metrics.jsonl",
                         "samples.jsonl", "memory.jsonl", "validation.jsonl", "resumes.jsonl", "tracking.json",
                         "dataset.json", "mlflow.db", "tensorboard", "wandb", "mlartifacts"})


def is_run_entry(name: str) -> bool:
    """Whether a run root's entry ``name`` is one a run writes (and a new run there replaces)."""
    from engine.checkpoint.layout import ASIDE_RE, STEP_RE, TMP_STEP_RE

    return (name in RUN_ENTRIES or bool(STEP_RE.match(name) or TMP_STEP_RE.match(name) or ASIDE_RE.match(name))
            or name.startswith((".superseded-", ".stale-", "mlflow.db-")) or name.endswith(".tmp"))


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"
        self.env_refs: dict = {}  # key -> `${oc.env:...}` text, written instead of the resolved value
        self.rows = None          # engine.checkpoint.carried_rows.RowCarrier, set when the loop starts

    def checkpoint_holding_it(self) -> Path | None:
        """The saved checkpoint this path is or lies inside, if any: a new run there would add
        files to that checkpoint (engine.checkpoint.layout.checkpoint_holding)."""
        from engine.checkpoint.layout import checkpoint_holding

        return checkpoint_holding(self.path)

    def existing_run_problem(self, overwrite: bool) -> tuple[str, str]:
        """(why a new run cannot start here, or ""; a note on what starting here will do, or "")."""
        inside = self.checkpoint_holding_it()
        if inside is not None:  # even with overwrite: the checkpoint is another run's saved state
            return (f"checkpoint.dir={self.path} is {'' if Path(os.path.abspath(self.path)) == inside else 'inside '}"
                    f"the checkpoint {inside} of the run in {inside.parent}/: a new run there would add files to a "
                    f"saved checkpoint (and `rl resume` would then refuse it). Choose a directory outside it, e.g. "
                    f"checkpoint.dir={inside.parent.parent / 'new_run'}, or continue that run with "
                    f"`rl resume {inside.parent}`."), ""
        if not self.path.is_dir():
            return "", ""
        steps = list_steps(self.path)
        if not (self.path / "run.json").exists() and not steps:
            return self._not_a_run_problem(), ""
        if overwrite:
            return "", f"checkpoint.overwrite=true: every file of the old run in {self.path}/ is deleted first."
        if not self.has_progress():
            return "", (f"{self.path}/ holds a run that stopped before writing any metrics or checkpoint; the new run "
                        f"replaces it.")
        latest = latest_complete(self.path)
        what = f"checkpoints up to {latest.path.name}" if latest else "a run (metrics, no complete checkpoint)"
        return (f"{self.path}/ already holds {what}. Continue it with `rl resume {self.path}`, start a new run "
                f"elsewhere with `checkpoint.dir=<new dir>`, or replace it with `checkpoint.overwrite=true` "
                f"(deletes every file of the old run)."), ""

    def _not_a_run_problem(self) -> str:
        """Why a directory that holds no run cannot take one: it is a filesystem root, or it
        already holds files under the names a run writes (a user's own config.yaml, wandb/,
        metrics.jsonl would be overwritten or mixed with the run's). "" when it can."""
        p = Path(os.path.abspath(self.path))
        if p == Path(p.anchor):
            return (f"checkpoint.dir={self.path} is the filesystem root: the run would write config.yaml, "
                    f"metrics.jsonl and step_N/ directories at the top of the filesystem. Choose a directory "
                    f"of its own, e.g. checkpoint.dir=runs/my_run.")
        try:
            clash = sorted(e.name for e in p.iterdir() if is_run_entry(e.name))
        except OSError:
            return ""  # unreadable: the writability probe names the problem
        if not clash:
            return ""
        shown = ", ".join(clash[:5]) + (f" and {len(clash) - 5} more" if len(clash) > 5 else "")
        return (f"checkpoint.dir={self.path} is not an rl run directory (no run.json) but already holds "
                f"{shown}: a run writes files under these names and would overwrite or mix with them. Choose "
                f"an empty or new directory, e.g. checkpoint.dir={self.path / 'rl_run'}.")

    def has_progress(self) -> bool:
        """Whether the run here got anywhere: a metrics row, or any checkpoint (even unfinished)."""
        if list_steps(self.path) or any(self.path.glob(TMP_PREFIX + "*")):
            return True
        try:
            return self.metrics_path.stat().st_size > 0
        except OSError:
            return False

    def clear_old_run(self) -> None:
        """Delete every file of the run that was here (not the lock of the run replacing it).
        Only the run's own entries (is_run_entry): anything else in the directory (the user's
        notes, an `rl export --out` directory put there) is kept; it used to be deleted too, also
        when a run without progress was replaced with no checkpoint.overwrite at all."""
        from engine.trainer.run_lock import LOCK_FILE

        for p in sorted(self.path.iterdir()):
            if p.name == LOCK_FILE or not is_run_entry(p.name):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def create(self, cfg: RunConfig, overrides: list[str], overwrite: bool,
               env_refs: dict | None = None) -> None:
        """Start a new run here. Refuses a directory that already holds a run that got anywhere
        (unless ``overwrite``); a run that stopped before its first metrics row is replaced."""
        problem, _note = self.existing_run_problem(overwrite)
        if problem:
            raise UserError(problem, title="run directory in use")
        if self.path.is_dir() and ((self.path / "run.json").exists() or list_steps(self.path)):
            self.clear_old_run()
        self.path.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        self.env_refs = dict(env_refs or {})
        # run.json first: a crash before the other files leaves a directory rl knows as its own
        # (a run without progress, replaced by the next `rl train`), never one it refuses as foreign
        write_json_atomic(self.path / "run.json", {"format": RUN_FORMAT, "version": VERSION,
                                                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                   "engine": cfg.engine.name,
                                                   "cwd": os.getcwd()})  # relative paths: engine/checkpoint/start_dir.py
        write_text_atomic(self.path / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(self.saved_config(cfg))))
        write_text_atomic(self.path / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
        write_json_atomic(self.path / "versions.json", package_versions())

    # -- secrets: values read from the environment are saved as their interpolation
    def saved_config(self, cfg: RunConfig) -> dict:
        from engine.config.interpolation import keep_env_references

        return keep_env_references(asdict(cfg), self.env_refs)

    def load_env_refs(self, overrides: list[str] | None = None) -> None:
        """On resume: the keys config.yaml keeps as `${oc.env:...}`, plus those the resume's
        overrides read from the environment."""
        from omegaconf import OmegaConf

        from engine import yaml_safe
        from engine.config.interpolation import env_references, override_env_references

        refs: dict = {}
        try:
            text = (self.path / "config.yaml").read_text()
            yaml_safe.check_bounded(text, str(self.path / "config.yaml"))  # an alias bomb hung resume
            saved = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
            refs = env_references(saved) if isinstance(saved, dict) else {}
        except Exception:  # no or unreadable config.yaml: the manifest's config is what resume used
            refs = {}
        self.env_refs = refs | override_env_references(list(overrides or []))

    # -- appending rows
    def append_metrics(self, record) -> None:
        append_line(self.metrics_path, json.dumps(record.to_json(), default=str))

    def append_validation(self, v) -> None:
        append_line(self.path / "validation.jsonl", json.dumps(v.to_json()))

    def append_memory(self, records: list) -> None:
        from engine.memory.report import save_records

        if records:
            save_records(records, self.path)

    def carry_rows_after(self, step: int) -> None:
        """From here on, each checkpoint carries the rows of the steps after ``step`` up to its own
        (engine/checkpoint/carried_rows.py): -1 for a new run, the resumed step on resume."""
        from engine.checkpoint.carried_rows import RowCarrier

        self.rows = RowCarrier(self.path, step)

    def save(self, cfg: RunConfig, workers, step: int, stream, ahead=None) -> Path:
        from engine.checkpoint.manifest import run_manifest
        from engine.checkpoint.save import finalize_checkpoint, prepare_tmp, tmp_dir

        prepare_tmp(self.path, step)
        extra = workers.save(str(self.path), step)
        if self.rows is None:
            self.carry_rows_after(-1)
        self.rows.write(tmp_dir(self.path, step), step)  # what resume needs to put back a torn row
        files = dict(extra.get("files") or {})
        if ahead is not None:  # trainer.mode samples ahead: the queued rollouts (engine/checkpoint/rollout_queue.py)
            from engine.checkpoint.rollout_queue import save_rollout_queue

            files.update(save_rollout_queue(tmp_dir(self.path, step), ahead.state_dict()))
        manifest = run_manifest(cfg, samples_seen=stream.pos.samples_seen, world_size=len(workers.info),
                                dp_size=workers.dp_size, facts=workers.checkpoint_facts(),
                                resolved_model_path=getattr(workers, "model_path", ""),
                                saved_config=self.saved_config(cfg), versions=package_versions())
        trainer_state = {"step": step, "samples_seen": stream.pos.samples_seen, "data": stream.state_dict(),
                         "learned_buckets": workers.bucket_state(),
                         "lr_scheduler": extra["lr_scheduler"]}
        if ahead is not None:  # prompts drawn for the queued rollouts: in samples_seen, not yet trained on
            trainer_state["queued_prompts"] = ahead.queued_prompts()
        final = finalize_checkpoint(self.path, step, trainer_state, manifest, files)
        prune(self.path, cfg.checkpoint.keep_last)
        return final
