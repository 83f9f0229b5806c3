"""The rollout worker: a Ray actor that samples apart from the ranks (trainer.mode=one_step_off|async|streamed).

It holds its own copy of the policy -- a plain Hugging Face model read by the torch sampler, or a
vLLM engine (rollout=vllm) -- and its own sampling generator. The driver loads the ranks' weights
into it after every update (``load_weights``, tagged with the policy version they are) and asks it
for batches (``generate``); Ray runs an actor's calls one at a time in the order they were sent,
so a batch is sampled with the last weights loaded before it was asked for, and each batch says
which version that was. The ranks go on training meanwhile: that is the overlap.

torch is imported inside the methods, as in engine/trainer/worker.py (the driver imports this
module to launch the actor before it has loaded torch)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from engine.config.resolved import ResolvedRun
from engine.host_heap import keep_host_heap
from engine.import_gc import imports_without_gc
from engine.threads import configure_torch_threads

if TYPE_CHECKING:
    import torch

    from engine.batch import SequenceBatch

# the worker's sampling stream, apart from every rank's (seed * 7919 + dp_rank)
ROLLOUT_SEED_OFFSET = 104_729


def rollout_seed(seed: int) -> int:
    return seed * 7919 + ROLLOUT_SEED_OFFSET


def worker_device(device: str, gpu_ids: list, visible_env: str | None) -> torch.device:
    """The device the worker computes on: for ``"cuda"`` the GPU Ray assigned it (``gpu_ids``:
    ``ray.get_gpu_ids()``), indexed as this process sees its devices (engine.device.assigned_cuda_index),
    as a rank's is. A bare ``cuda`` is the current device, cuda:0, which is another GPU (rank 0's)
    where the cluster keeps every GPU visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES). Sharing
    rank 0's GPU the worker is assigned none and sees only that one: cuda:0."""
    import torch

    if device != "cuda":
        return torch.device(device)
    from engine.device import assigned_cuda_index

    return torch.device("cuda", assigned_cuda_index([str(g) for g in gpu_ids], visible_env, 0))


class RolloutWorker:
    def __init__(self, run: ResolvedRun, threads: int):
        self.run, self.cfg = run, run.config
        with imports_without_gc():  # engine/import_gc.py
            configure_torch_threads(threads)
        if self.cfg.trainer.keep_host_heap:
            keep_host_heap()
        self.version = -1
        self.sampler = self.model = None
        self.sleeps = True  # setup: whether the sampler frees the device after each call

    def setup(self, model_path: str, vocab: dict, state_dict: dict, version: int, device: str = "cpu",
              shares_gpu: bool = True) -> dict:
        """Build the sampler on ``device`` from the ranks' exported weights (``state_dict``, HF names).
        ``shares_gpu``: on the first rank's GPU (else a GPU of its own, where nothing else needs
        the memory a sleeping vLLM engine would give back)."""
        import torch

        from engine.trainer.rollout_worker import rollout_seed

        if device == "cuda":
            import ray

            self.device = worker_device(device, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device(device)
        self.vocab, self.model_path = vocab, model_path
        self.sleeps = shares_gpu
        self.generator = torch.Generator().manual_seed(rollout_seed(self.cfg.trainer.seed))
        if self.cfg.rollout.name == "vllm":
            from engine.rollout.vllm_sampler import VLLMSampler, hf_config_for

            rows = self.cfg.data.train_batch_size * self.cfg.algorithm.rollout_n
            self.sampler = VLLMSampler(self.cfg, hf_config_for(self.cfg, model_path, vocab), state_dict,
                                       vocab["pad"], vocab["eos"], self.device, 0, rows)
        else:
            from engine.model.build import build_hf_model
            from engine.rollout.torch_sampler import TorchSampler

            self.model = build_hf_model(self.cfg.model, model_path, vocab["size"], self.cfg.trainer.seed,
                                        vocab["pad"], vocab["eos"]).to(self.device)
            self.model.eval()
            self.model.requires_grad_(False)
            self._load_into_model(state_dict)
            self.sampler = TorchSampler(self.cfg.rollout, vocab["pad"], vocab["eos"], self.device)
        self.sampler.set_ends(vocab)
        self.version = version
        return {"pid": os.getpid(), "device": str(self.device)}

    def _load_into_model(self, state_dict: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"the rollout worker's model does not match the ranks' weights: missing "
                               f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")

    def load_weights(self, state_dict: dict, version: int) -> float:
        """The policy after update ``version``; returns seconds spent."""
        t0 = time.perf_counter()
        if self.model is not None:
            self._load_into_model(state_dict)
        else:
            self.sampler.sync_weights(state_dict)
        self.version = version
        return time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], n: int) -> tuple[SequenceBatch, dict]:
        """``n`` samples per prompt with the weights loaded last; stats carry their ``version``."""
        import torch

        from engine.trainer.worker import rss_peak_bytes

        t0 = time.perf_counter()
        with torch.no_grad():
            batch = self.sampler.generate(self.model, prompts, n, self.generator)
        self._sleep()
        return batch, {"time": time.perf_counter() - t0, "kv_cache_bytes": self.sampler.last_kv_cache_bytes,
                       "rss_peak": rss_peak_bytes(), "version": self.version}

    def generate_stream(self, prompts: list[list[int]], n: int):
        """``generate``'s rows as ``(first row, SequenceBatch)`` pieces, each prompt group yielded
        as soon as all its samples have ended (the torch sampler), then the stats (trainer.mode=
        streamed: the ranks update on the groups that are complete while the rest decode). Called
        as a Ray streaming generator (RolloutAhead.stream_groups)."""
        from engine.trainer.worker import rss_peak_bytes

        t0 = time.perf_counter()  # (the sampler sets no-grad around each decode step, never across a yield)
        yield from self.sampler.generate_pieces(self.model, prompts, n, self.generator, stream=True)
        self._sleep()
        yield {"time": time.perf_counter() - t0, "kv_cache_bytes": self.sampler.last_kv_cache_bytes,
               "rss_peak": rss_peak_bytes(), "version": self.version}

    def _sleep(self) -> None:
        """After a call: a vLLM engine on the first rank's GPU frees its KV cache and moves its
        weights to the host until the next call or sync. On a GPU of its own it stays awake: a
        sleep there freed memory nothing else uses and cost a host round trip of the weights per
        call (per turn, in multi-turn runs)."""
        if self.sleeps:
            self.sampler.sleep()

    def rng_state(self):
        """The sampling generator's state (a uint8 tensor): what a checkpoint keeps of this worker."""
        return self.generator.get_state()

    def set_rng_state(self, state) -> None:
        self.generator.set_state(state)

    def shutdown(self) -> None:
        if self.sampler is not None:
            self.sampler.shutdown()
