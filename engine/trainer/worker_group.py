"""The driver's handle on all rank workers: start them as Ray actors in one process group,
scatter a batch over data-parallel ranks, gather results back in order."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict

import torch

from engine.batch import SequenceBatch
from engine.config.schema import RunConfig
from engine.threads import rank_env
from engine.trainer.ray_cluster import get


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_slices(n: int, parts: int) -> list[slice]:
    """Contiguous, near-equal slices of range(n)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


class WorkerGroup:
    def __init__(self, cfg: RunConfig, model_path: str, vocab: dict):
        import ray

        from engine.trainer.worker import RankWorker

        self.cfg = cfg
        self.model_path = model_path  # the resolved local directory ("" = tiny built-in model)
        self.timeout = cfg.trainer.ray_timeout_s
        n = cfg.trainer.nprocs
        threads = cfg.trainer.threads_per_rank or max(1, (os.cpu_count() or 1) // n)
        init = f"tcp://127.0.0.1:{free_port()}"
        gpus = 1 if cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available()) else 0
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(RankWorker)
        cfg_dict = asdict(cfg)
        env = {**rank_env(threads), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # passive OpenMP waits: engine/threads.py
        self.actors = [actor.options(runtime_env={"env_vars": env}).remote(cfg_dict, r, n, init, model_path, vocab,
                                                                             threads) for r in range(n)]
        self.info = get([a.setup.remote() for a in self.actors], self.timeout, "the ranks to start")
        self.dp_size = self.info[0]["dp_size"]
        # the first rank of each data-parallel group receives (and returns) that group's data
        self.dp_leaders = {}
        for i, inf in enumerate(self.info):
            self.dp_leaders.setdefault(inf["dp_rank"], i)

    def _all(self, method: str, per_rank_args: list[tuple], what: str):
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return get(refs, self.timeout, what)

    def _dp_args(self, shards: list) -> list[tuple]:
        return [(shards[inf["dp_rank"]],) for inf in self.info]

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False):
        slices = shard_slices(len(prompts), self.dp_size)
        shards = [prompts[s] for s in slices]
        args = [(shards[inf["dp_rank"]], n, greedy) for inf in self.info]
        out = self._all("generate", args, "rollout")
        parts = [out[self.dp_leaders[d]][0] for d in range(self.dp_size) if len(shards[d])]
        stats = [o[1] for o in out]
        return SequenceBatch.concat(parts), stats

    def log_probs(self, batch: SequenceBatch, ref: bool) -> torch.Tensor:
        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        out = self._all("log_probs", [(shards[inf["dp_rank"]], ref) for inf in self.info],
                        "reference log-probs" if ref else "old log-probs")
        T = batch.input_ids.shape[1]
        full = torch.zeros(len(batch), T)
        for d, s in enumerate(slices):
            lp = out[self.dp_leaders[d]]
            full[s, :lp.shape[1]] = lp
        return full

    def train_step(self, batch: SequenceBatch):
        """One optimizer step on every rank; returns the combined engine.trainer.rank_results.UpdateResult."""
        from engine.trainer.rank_results import combine_update

        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        outs = self._all("train_step", self._dp_args(shards), "the policy update")
        return combine_update(outs, [self.dp_leaders[d] for d in range(self.dp_size)])

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """PPO: the critic's values [B, T], gathered from the data-parallel ranks."""
        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        out = self._all("values", self._dp_args(shards), "the critic's values")
        full = torch.zeros(len(batch), batch.input_ids.shape[1])
        for d, s in enumerate(slices):
            v = out[self.dp_leaders[d]]
            full[s, :v.shape[1]] = v
        return full

    def critic_train_step(self, batch: SequenceBatch):
        """PPO: one critic optimizer step on every rank; combined like train_step."""
        from engine.trainer.rank_results import combine_update

        slices = shard_slices(len(batch), self.dp_size)
        shards = [batch.select(s) for s in slices]
        outs = self._all("critic_train_step", self._dp_args(shards), "the critic update")
        return combine_update(outs, [self.dp_leaders[d] for d in range(self.dp_size)])

    def save(self, run_dir: str, step: int) -> dict:
        """Every rank writes its shards; returns rank 0's non-tensor state (LR scheduler)."""
        return self._all("save", [(run_dir, step)] * len(self.actors), "the checkpoint save")[0]

    def load(self, step_dir: str, plan: dict) -> list[dict]:
        return self._all("load", [(step_dir, plan)] * len(self.actors), "the checkpoint load")

    def checkpoint_facts(self) -> dict:
        return get(self.actors[0].checkpoint_facts.remote(), self.timeout, "checkpoint facts")

    def bucket_state(self) -> list:
        return get(self.actors[0].bucket_state.remote(), self.timeout, "bucket state")

    def onload(self, step: int) -> list[dict]:
        return self._all("onload", [(step,)] * len(self.actors), "onload")

    def offload(self) -> list[dict]:
        """Offload every rank; returns per-rank {"report", "memory": [phase records]}."""
        return self._all("offload", [()] * len(self.actors), "offload")

    def shutdown(self) -> None:
        import ray

        try:
            get([a.shutdown.remote() for a in self.actors], 30, "shutdown")
        except Exception:
            pass
        for a in self.actors:
            ray.kill(a)
