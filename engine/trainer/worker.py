"""One training rank: a Ray actor that owns the engine (policy, reference, optimizer) and
the sampler, inside a torch.distributed process group shared with the other ranks.

torch is imported by the rank itself (in ``__init__``), not at the top of this module: the driver
imports this module to launch the actors before it has loaded torch (engine/trainer/worker_group.py)."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config.resolved import ResolvedRun, uses_rollout_worker
from engine.config.schema import RunConfig
from engine.interfaces import RolloutSampler, TrainingEngine
from engine.memory.oom import oom_guard
from engine.host_heap import keep_host_heap
from engine.import_gc import imports_without_gc
from engine.threads import adapt_threads, configure_torch_threads, omp_wait_now, restore_rank_priority

if TYPE_CHECKING:
    import torch

    from engine.batch import SequenceBatch


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _preload(cfg: RunConfig) -> None:
    """Import what ``setup`` builds with (~2 s on a 2-core machine), while the driver is still
    busy with its own start-up and has not called ``setup`` yet. A failing import is left for
    ``setup`` to raise, as a failure of the setup call rather than of the actor's creation."""
    try:
        import importlib

        import transformers.modeling_utils  # noqa: F401  (every engine builds or reads an HF model)

        from engine.backends.registry import BACKENDS

        for module in BACKENDS[cfg.engine.name].preload:
            importlib.import_module(module)
    except Exception:
        pass


class RankWorker:
    def __init__(self, run: ResolvedRun, rank: int, world_size: int, threads: int):
        self.run = run  # resolved once on the driver (engine/config/resolved.py)
        self.cfg: RunConfig = run.config
        self.rank, self.world_size = rank, world_size
        self._store_fd = None
        self.model_path, self.vocab = "", {}  # set by setup()
        note = restore_rank_priority()  # Ray's niceness 15 -> the launching command's (engine/threads.py)
        if note:
            print(f"rl rank {rank}: {note}", file=sys.stderr, flush=True)
        with imports_without_gc():  # torch, transformers and the backend (engine/import_gc.py)
            configure_torch_threads(threads)  # before torch's first parallel region: its thread pool
            import torch

            # RL_DETERMINISTIC=1 (a diagnosis aid: bench/gpu_check_train.sh): torch's deterministic kernels only
            torch.use_deterministic_algorithms(os.environ.get("RL_DETERMINISTIC") == "1", warn_only=True)
            _preload(self.cfg)
        if self.cfg.trainer.keep_host_heap:  # steps reuse freed memory, no page faults (engine/host_heap.py)
            keep_host_heap()
        # trainer.adapt_threads (with threads_per_rank=0): follow the free cores each phase; only
        # when asked, because the thread count changes how float sums are split
        t = self.cfg.trainer
        self._max_threads = threads if t.threads_per_rank == 0 and t.adapt_threads else 0

    # ---- setup --------------------------------------------------------------------------
    def placement(self) -> dict:
        """Where Ray put this rank: node id and address, host name, pid, the GPUs Ray assigned it
        (``gpu_ids``, as CUDA_VISIBLE_DEVICES names them), and how its OpenMP threads wait
        (``omp_wait``: the spin count before sleeping, engine/threads.py)."""
        import socket

        import ray

        from engine.trainer.rendezvous import node_address

        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_address(),
                "hostname": socket.gethostname(), "pid": os.getpid(), "omp_wait": omp_wait_now(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: bind the process group's store socket on this node's address; (host, port)."""
        from engine.trainer.rendezvous import node_address, open_store_socket

        host = node_address()
        self._store_fd, port = open_store_socket(host)
        return host, port

    def check_shared_dir(self, marker: str, token: str) -> str:
        """'' when ``marker`` (written by the driver) holds ``token`` here, else what this rank saw."""
        try:
            seen = Path(marker).read_text()
        except OSError as e:
            return f"cannot read {marker}: {e.strerror or e}"
        return "" if seen == token else f"{marker} holds another run's marker"

    def setup(self, store_host: str, store_port: int, model_path: str, vocab: dict) -> dict:
        """Join the process group at rank 0's store and build the engine and sampler for
        ``model_path`` ("" = the tiny built-in model) with ``vocab`` ({"size", "pad", "eos"})."""
        import torch
        import torch.distributed as dist

        from engine.device import dist_backend, resolve_device
        from engine.trainer.rendezvous import make_store, node_address, pin_interfaces

        self.model_path, self.vocab = model_path, vocab
        if self.cfg.trainer.device == "cuda" and not torch.cuda.is_available():
            import socket

            from engine.errors import ConfigError

            # the driver checks its own machine only when the ranks run there (preflight)
            raise ConfigError(f"`trainer.device=cuda` but rank {self.rank} on {socket.gethostname()} sees no CUDA "
                              f"device. Run on a cluster whose workers have GPUs, or use trainer.device=auto "
                              f"(or cpu).", title="invalid config value")
        import ray

        from engine.device import assigned_cuda_index

        # the GPU Ray assigned this rank, not rank % visible devices (equal only when Ray hides the rest)
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.device = resolve_device(self.cfg.trainer.device,
                                     assigned_cuda_index(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), self.rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        pin_interfaces(node_address())
        store = make_store(store_host, store_port, self.rank, self.world_size, self._store_fd,
                           self.cfg.trainer.ray_timeout_s)
        dist.init_process_group(dist_backend(self.device), store=store, rank=self.rank, world_size=self.world_size)
        with oom_guard("load_model", self.rank, 0, self.device):
            self._build()
        return {"rank": self.rank, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "device": str(self.device), "params": self.engine.param_count(),
                "pid": os.getpid(), "micro_batch_budget": self.micro_batch_budget}

    def _build(self) -> None:
        import torch

        e = self.cfg.engine
        self.micro_batch_budget = ""
        if e.max_tokens_per_micro_batch == 0 and e.micro_batch_size == 0:
            self.micro_batch_budget = self._fit_micro_batch_budget()
        if self.device.type == "cuda" and self.rank == 0:
            self._warn_if_over_the_device()
        self.engine: TrainingEngine = self._make_engine()
        torch.manual_seed(self.cfg.trainer.seed)
        self.engine.build()
        models, optimizers = {"policy": self.engine.model}, [self.engine.optimizer]
        if self.cfg.algorithm.name == "ppo":  # the engine checkpoints and offloads it with its own state
            self.engine.critic = self._make_critic()
            models["critic"] = self.engine.critic.model
            optimizers.append(self.engine.critic.optimizer)
        from engine.memory.tracker import MemoryTracker

        self.tracker = MemoryTracker(self.device, rank=self.rank, models=models, optimizer=optimizers)
        self.engine.tracker = self.tracker
        self.step = 0
        self.dp_rank, self.dp_size = self.engine.dp_rank, self.engine.dp_size
        self.sampler: RolloutSampler = self._make_sampler()
        self._weights_stale = False  # the rollout engine holds older weights than the trainer
        self._sync_probe = None      # fixed sequences for rollout.verify_sync (first rollout's rows)
        self.generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 7919 + self.dp_rank)

    def _fit_micro_batch_budget(self) -> str:
        """engine.max_tokens_per_micro_batch=0: fit the budget to this rank's memory
        (engine/memory/micro_batch_fit.py) before anything is built, take the smallest over the
        ranks (all split alike) and set it in this rank's config; returns what the plan shows.
        Every rank raises when any rank cannot fit one sequence."""
        import socket

        import torch
        import torch.distributed as dist

        from engine.errors import UserError
        from engine.memory.estimate import model_structure
        from engine.env_info import host_available_bytes
        from engine.memory.micro_batch_fit import fit_token_budget, shared_worker_bytes

        ranks = [None] * self.world_size
        worker_shares = False
        if self.device.type == "cuda":
            free, total = (int(b) for b in torch.cuda.mem_get_info(self.device))
            device_bytes = free
            if self.rank == 0 and self.run.versions_ahead:
                import ray

                # rollout_ahead.rollout_worker_gpus's rule, on the count the driver will read: every
                # rank holds its GPU by now (the process group is up), so no GPU free = it shares ours
                worker_shares = ray.available_resources().get("GPU", 0) < 1
        else:  # the host's memory, shared by the ranks on it
            dist.all_gather_object(ranks, socket.gethostname())
            device_bytes = (host_available_bytes() or 0) // max(1, ranks.count(socket.gethostname()))
        try:
            st = model_structure(self.cfg, hf_config_path=self.model_path or None, vocab_size=self.vocab["size"])
            worker = shared_worker_bytes(self.cfg, st, total) if worker_shares else 0
            fit, failure = fit_token_budget(self.cfg, st, device_bytes, worker_bytes=worker), None
        except UserError as err:
            fit, failure = None, err
        dist.all_gather_object(ranks, (fit.tokens if fit else 0, fit.describe() if fit else "",
                                       failure.message if failure else ""))
        failed = [(r, msg) for r, (_, _, msg) in enumerate(ranks) if msg]
        if failed:
            r, msg = failed[0]
            raise UserError(f"rank {r}: {msg}", title="the micro-batch does not fit")
        r = min(range(self.world_size), key=lambda i: ranks[i][0])
        self.cfg.engine.max_tokens_per_micro_batch = ranks[r][0]
        return ranks[r][1] + (f", rank {r}'s" if self.world_size > 1 else "")

    def _warn_if_over_the_device(self) -> None:
        """The run's memory estimate against this GPU's total (engine/memory/fit_warning.py): a
        warning on stderr when the estimated peak is over it. Never stops the run."""
        import torch

        from engine.memory.estimate import estimate_memory
        from engine.memory.fit_warning import fit_warning

        try:
            total = int(torch.cuda.mem_get_info(self.device)[1])
            est = estimate_memory(self.cfg, hf_config_path=self.model_path or None, vocab_size=self.vocab["size"],
                                  device_memory_bytes=total)
            msg = fit_warning(est)
        except Exception:  # an estimate that cannot be made says nothing about the run
            return
        if msg:
            print(f"rl rank 0: warning: {msg}", file=sys.stderr, flush=True)

    def _make_sampler(self):
        if self.cfg.rollout.name == "vllm" and not self.run.versions_ahead:
            # (sampling ahead: the rollout worker holds the vLLM engine; ranks only validate, with torch)
            from engine.rollout.vllm_sampler import VLLMSampler

            return VLLMSampler.from_engine(self.cfg, self.engine, self.model_path, self.vocab, self.device,
                                           self.rank, self.dp_size)
        from engine.rollout.torch_sampler import TorchSampler

        sampler = TorchSampler(self.cfg.rollout, self.vocab["pad"], self.vocab["eos"], self.device,
                               record_routing=self.cfg.algorithm.router_replay != "off")
        sampler.set_ends(self.vocab)
        return sampler

    def _make_critic(self):
        from engine.backends.registry import critic_class

        return critic_class(self.cfg.engine.name)(self.cfg, self.engine)

    def _make_engine(self):
        from engine.backends.registry import engine_class

        c = self.cfg
        return engine_class(c.engine.name)(c, self.model_path, self.vocab["size"], self.vocab["pad"],
                                           self.vocab["eos"], self.device, self.run.updates_per_step)

    # ---- phases -------------------------------------------------------------------------
    def onload(self, step: int) -> dict:
        self.step = step
        with self.tracker.phase("onload", step) as t:
            report = self.engine.onload()
            t.record_offload(report)
        return asdict(report)

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False,
                 keep_awake: bool = False) -> tuple[SequenceBatch, dict]:
        """``n`` samples per prompt. A vLLM engine on the GPU sleeps after the call (its KV cache
        freed, its weights on the host) unless ``keep_awake``: a multi-turn rollout's turns, which
        end with ``sleep_sampler`` once the episodes are done."""
        t0 = time.perf_counter()
        self._before_rollout()
        with self.tracker.phase("rollout", self.step) as t:
            if self.sampler.reads_live_model:
                with self.engine.generation_model() as model:
                    batch = self.sampler.generate(model, prompts, n, self.generator, greedy=greedy)
            else:  # vLLM holds its own synced copy: no full-weight gather here
                batch = self.sampler.generate(None, prompts, n, self.generator, greedy=greedy)
                if self._sync_probe is None:
                    self._sync_probe = batch.select(slice(0, 4))
            t.record_bytes("kv_cache", self.sampler.last_kv_cache_bytes)
            m = self.sampler.memory()
            if m is not None:
                t.note(f"vllm: kv cache {m['kv_cache_bytes']} B, engine processes rss {m['engine_rss_bytes']} B"
                       + (f", outside torch {m['outside_torch_bytes']} B" if "outside_torch_bytes" in m else ""))
        if not keep_awake:
            self.sampler.sleep()  # vLLM on GPU: free its KV cache and weights until the next sync
        return batch, self._rollout_stats(t0)

    def sleep_sampler(self) -> None:
        """The end of a rollout whose calls kept the engine awake (``generate(keep_awake=True)``)."""
        self.sampler.sleep()

    def generate_stream(self, prompts: list[list[int]], n: int):
        """trainer.stream_groups: ``generate``'s batch from the torch sampler as ``(first row,
        SequenceBatch)`` pieces, each prompt group yielded as soon as all its samples have ended, so
        the driver scores it while the other rows decode; the last item is the call's stats.
        Called as a Ray streaming generator (WorkerGroup.generate_stream)."""
        t0 = time.perf_counter()
        self._before_rollout()
        with self.tracker.phase("rollout", self.step) as t:
            with self.engine.generation_model() as model:
                yield from self.sampler.generate_pieces(model, prompts, n, self.generator, stream=True)
            t.record_bytes("kv_cache", self.sampler.last_kv_cache_bytes)
        yield self._rollout_stats(t0)

    def _before_rollout(self) -> None:
        if self._max_threads:
            adapt_threads(self._max_threads)
        if self._weights_stale:
            self.sync_weights()

    def _rollout_stats(self, t0: float) -> dict:
        return {"time": time.perf_counter() - t0, "kv_cache_bytes": self.sampler.last_kv_cache_bytes,
                "rss_peak": rss_peak_bytes()}

    def sync_weights(self) -> float:
        """Push the updated policy into the rollout engine (vLLM; a collective on FSDP, so
        every rank runs it: generate() calls it first whenever weights changed)."""
        with self.tracker.phase("weight_sync", self.step) as t:
            t0 = time.perf_counter()
            state = self.engine.export_hf_state_dict()
            export_s = time.perf_counter() - t0
            seconds = self.sampler.sync_weights(state)
            del state
            s = self.sampler.last_sync
            t.note(f"vllm sync: export {export_s:.3f} s, write {s['write_s']:.3f} s, reload {s['reload_s']:.3f} s, "
                   f"{s['bytes']} B")
            if self.cfg.rollout.verify_sync and self._sync_probe is not None:
                check = self.sampler.verify_sync(self.engine, self._sync_probe)  # raises on mismatch
                t.note(f"verify_sync: max |dlogp| {check.max_abs:.2e} over {check.tokens} tokens")
        self._weights_stale = False
        return seconds

    def export_weights(self, keep: bool, release_cache: bool = False) -> dict | None:
        """The policy's full weights with HF names (a collective on FSDP: every rank calls it);
        only the rank that ``keep``s them returns them (the rollout worker's copy, trainer.mode).
        ``release_cache``: a rollout worker shares this rank's GPU and claims memory next, so
        hand back what torch keeps cached here (the update's and the export's freed blocks)."""
        with self.tracker.phase("weight_sync", self.step):
            state = self.engine.export_hf_state_dict(keep=keep)
        if release_cache and self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        return state if keep else None

    def log_probs(self, batch: SequenceBatch, ref: bool = False) -> torch.Tensor:
        with self.tracker.phase("ref_log_probs" if ref else "old_log_probs", self.step):
            lp, _ = self.engine.compute_log_probs(batch, ref=ref)
        return lp

    def routing_report(self, batch: SequenceBatch) -> dict:
        """MoE routing metrics' partial sums on this rank's rows (algorithm.router_replay on)."""
        with self.tracker.phase("old_log_probs", self.step):  # a log-prob pass too
            return self.engine.routing_report(batch)

    def _policy_loss(self):
        from engine.algorithms.policy_loss import OffPolicy, PolicyLoss

        # report: pi_theta / pi_rollout when another copy of the policy sampled (the rollout worker)
        return PolicyLoss(self.cfg.algorithm, self.dp_size, OffPolicy(
            self.run.rollout_is, self.run.behavior_ratio, uses_rollout_worker(self.cfg)))

    def train_step(self, batch: SequenceBatch) -> dict:
        t0 = time.perf_counter()
        if self._max_threads:
            adapt_threads(self._max_threads)
        with self.tracker.phase("update", self.step):
            stats = self.engine.train_step(batch, self._policy_loss())
        self._weights_stale = not self.sampler.reads_live_model
        return self._update_result(stats, time.perf_counter() - t0)

    def _update_result(self, stats, seconds: float) -> dict:
        return {"metrics": stats.metrics, "replicated": stats.replicated, "tokens": stats.tokens,
                "padded_tokens": stats.padded_tokens, "shapes": sorted(stats.shapes), "time": seconds,
                "rss_peak": rss_peak_bytes()}

    # trainer.mode=streamed: one optimizer step over chunks of prompt groups sent as they complete
    def stream_begin(self) -> None:
        if self._max_threads:
            adapt_threads(self._max_threads)
        self._stream_s = 0.0
        self.engine.stream_begin()

    def stream_chunk(self, chunk: SequenceBatch) -> None:
        t0 = time.perf_counter()
        with self.tracker.phase("update", self.step):
            self.engine.stream_chunk(chunk, self._policy_loss())
        self._stream_s += time.perf_counter() - t0

    def stream_finish(self, n_tokens: float, n_seqs: float) -> dict:
        t0 = time.perf_counter()
        with self.tracker.phase("update", self.step):
            stats = self.engine.stream_finish(n_tokens, n_seqs, self._policy_loss())
        self._weights_stale = not self.sampler.reads_live_model
        return self._update_result(stats, self._stream_s + time.perf_counter() - t0)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """PPO: the critic's V(tokens < t) on the response tokens (no grad)."""
        with self.tracker.phase("values", self.step):
            return self.engine.critic.compute_values(batch)

    def critic_train_step(self, batch: SequenceBatch) -> dict:
        """PPO: one critic optimizer step (batch carries values and returns)."""
        t0 = time.perf_counter()
        with self.tracker.phase("critic_update", self.step):
            out = self.engine.critic.train_step(batch)
        return out | {"tokens": 0, "padded_tokens": 0, "shapes": [], "time": time.perf_counter() - t0,
                      "rss_peak": rss_peak_bytes()}

    def offload(self) -> dict:
        """End of step: offload as configured, and hand back this step's memory records."""
        with self.tracker.phase("offload", self.step) as t:
            report = self.engine.offload()
            t.record_offload(report)
        return {"report": asdict(report), "memory": self.tracker.pop_records()}

    # ---- checkpoints --------------------------------------------------------------------
    def save(self, run_dir: str, step: int) -> dict:
        from engine.checkpoint.save import rng_state, save_rank_state

        with oom_guard("save_checkpoint", self.rank, step, self.device):
            files = save_rank_state(Path(run_dir), step, self.engine.checkpoint_state(for_save=True), self.rank,
                                    rng_state(self.generator))
        return {"lr_scheduler": self.engine.lr_scheduler.state_dict(), "files": files}

    def checkpoint_facts(self) -> dict:
        """What the manifest records about the model and optimizer (rank 0 asks)."""
        return {"optimizer_type": type(self.engine.optimizer).__name__,  # AdamW; megatron's optimizer on CUDA
                "param_state": self.engine.optimizer_coverage(),
                "params": self.engine.param_shapes(),
                "num_params": self.engine.param_count(),
                "lora": self.engine.lora_reference}

    def load(self, step_dir: str, plan: dict) -> dict:
        from engine.checkpoint.restore import load_rank_state

        with oom_guard("load_checkpoint", self.rank, plan.get("step"), self.device):
            out = load_rank_state(Path(step_dir), self.engine, self.rank, self.generator, plan)
        self._weights_stale = not self.sampler.reads_live_model
        return out

    def bucket_state(self) -> list:
        p = self.engine.bucket_policy
        return p.state_dict() if p is not None else []

    def shutdown(self) -> None:
        import torch.distributed as dist

        sampler = getattr(self, "sampler", None)  # None when setup() failed before making it
        if sampler is not None:
            sampler.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
