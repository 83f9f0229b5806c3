"""The run directory: resolved config, overrides, versions, metrics and checkpoints."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from engine.checkpoint.layout import (RUN_FORMAT, VERSION, complete_steps, latest_complete, list_steps, prune,
                                      write_json_atomic)
from engine.config.schema import RunConfig
from engine.env_info import package_versions
from engine.errors import UserError


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"

    def create(self, cfg: RunConfig, overrides: list[str], overwrite: bool) -> None:
        """Start a new run here. Refuses to touch a directory that already holds a run."""
        existing = list_steps(self.path)
        if (self.path / "run.json").exists() or existing:
            if not overwrite:
                latest = latest_complete(self.path)
                what = f"checkpoints up to {latest.path.name}" if latest else "a run"
                raise UserError(
                    f"{self.path}/ already holds {what}. Continue it with `rl resume {self.path}`, start a new "
                    f"run elsewhere with `checkpoint.dir=<new dir>`, or replace it with "
                    f"`checkpoint.overwrite=true` (deletes its checkpoints).", title="run directory in use")
            for s in existing:
                shutil.rmtree(s.path)
            for name in ("metrics.jsonl", "run.json"):
                (self.path / name).unlink(missing_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        (self.path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))))
        (self.path / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
        write_json_atomic(self.path / "versions.json", package_versions())
        write_json_atomic(self.path / "run.json", {"format": RUN_FORMAT, "version": VERSION,
                                                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                   "engine": cfg.engine.name})

    def append_metrics(self, record) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record.to_json(), default=str) + "\n")

    def append_validation(self, v) -> None:
        with open(self.path / "validation.jsonl", "a") as f:
            f.write(json.dumps(v.to_json()) + "\n")

    def append_memory(self, records: list) -> None:
        from engine.memory.report import save_records

        if records:
            save_records(records, self.path)

    def save(self, cfg: RunConfig, workers, step: int, stream) -> Path:
        from engine.checkpoint.save import finalize_checkpoint, prepare_tmp

        prepare_tmp(self.path, step)
        extra = workers.save(str(self.path), step)
        facts = workers.checkpoint_facts()
        info = workers.info
        e = cfg.engine
        tp = getattr(e, "tensor_model_parallel_size", 1)
        pp = getattr(e, "pipeline_model_parallel_size", 1)
        cp = getattr(e, "context_parallel_size", 1)
        manifest = {
            "samples_seen": stream.pos.samples_seen, "world_size": len(info), "engine": e.name,
            "parallel": {"dp": workers.dp_size, "tp": tp, "pp": pp, "cp": cp},
            "model": {"preset": cfg.model.preset, "path": cfg.model.path, "num_params": facts["num_params"],
                      "resolved_path": getattr(workers, "model_path", ""), "params": facts["params"],
                      **({"lora": facts["lora"]} if facts.get("lora") else {})},
            "optimizer": {"type": "AdamW", "flattened": True, "param_state": facts["param_state"]},
            "config": asdict(cfg), "versions": package_versions(),
        }
        trainer_state = {"step": step, "samples_seen": stream.pos.samples_seen, "data": stream.state_dict(),
                         "learned_buckets": workers.bucket_state(),
                         "lr_scheduler": extra["lr_scheduler"]}
        final = finalize_checkpoint(self.path, step, trainer_state, manifest, extra.get("files"))
        prune(self.path, cfg.checkpoint.keep_last)
        return final
