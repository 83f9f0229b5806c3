"""Moving trainer weights into a running vLLM engine (the vLLM rollout's weight sync).

Two halves, one per process:

* trainer side (``HFExportDir``): a per-rank directory (on /dev/shm when available) holding
  the policy as a Hugging Face checkpoint: ``config.json`` written once at startup, and
  ``model.safetensors`` rewritten (atomically) at every sync;
* ``start_dir``: where vLLM starts from, a directory holding only ``config.json``, named by its
  content in rl's cache. vLLM keys its torch.compile cache (CUDA) by the model's path among other
  things, so starting from the per-run export directory (a fresh temporary name) compiled the
  model from scratch at every run; from ``start_dir`` a second run of the same architecture
  finds the first one's compiled graphs. vLLM starts there with ``load_format="dummy"`` (no
  weights read) and the first ``rl_reload_weights`` loads the exported ones;
* vLLM side (``WeightSyncExtension``): methods added to vLLM's worker class through
  ``LLM(worker_extension_cls=...)`` and called with ``llm.collective_rpc(name, args)``.
  Arguments cross the process boundary as plain data (a path, a bool), never tensors.

``rl_reload_weights`` uses vLLM's in-place reload (``Worker.reload_weights``: layer-wise
load, then the same post-load processing as at startup, e.g. the CPU backend's GEMM weight
prepacking), then repairs tied embeddings: with ``tie_word_embeddings`` the checkpoint has
no ``lm_head.weight`` (vLLM skips it), so the reload re-processes the embedding layer but
never the LM head, whose prepacked CPU GEMM handle keeps the *old* weights (measured: log-prob
errors of 17-30 nats after one sync). Re-running the head's ``process_weights_after_loading``
rebuilds it from the shared, freshly loaded tensor.

This module is imported inside vLLM's worker process; it must not import vLLM at the top.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine import json_safe
from engine.owned_dirs import OwnedDir

WEIGHTS_FILE = "model.safetensors"


def shm_dir() -> str | None:
    """/dev/shm when it is a writable directory (RAM-backed: no disk I/O per sync), else None."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def export_base(weights_bytes: int) -> str | None:
    """Where the export directory goes: /dev/shm when it has room for ``weights_bytes`` (the
    caller's count: two copies of the weights for every vLLM engine on this host, since a sync
    writes the new file beside the old one, then renames it), else None: the temp directory
    (TMPDIR). A container's /dev/shm is 64 MiB unless it was started with --shm-size or
    --ipc=host, too small for any real model's weights."""
    shm = shm_dir()
    if shm is None:
        return None
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return None
    return shm if free >= weights_bytes + (16 << 20) else None


def start_dir(hf_config, cache: Path, tag: str = "") -> Path | None:
    """``cache/vllm-start/<hash of config.json>-<tag>``, holding ``hf_config``'s config.json
    (without ``_name_or_path``, which names wherever the model was read from), written once by
    whichever run gets there first and never changed (same name, same content). ``tag``: the
    device (``cuda3``), so the engines of one host's ranks, compiling at the same time, each keep
    their own compile cache (vLLM writes its index file in place). None when it cannot be written
    or read (a read-only cache): the caller starts from its own export directory instead."""
    config = json_safe.loads(hf_config.to_json_string(use_diff=True))
    config.pop("_name_or_path", None)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    final = Path(cache) / "vllm-start" / (hashlib.sha256(text.encode()).hexdigest()[:16] + (f"-{tag}" if tag else ""))
    try:
        if (final / "config.json").is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        (tmp / "config.json").write_text(text)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from the other users of a shared cache
        try:
            os.rename(tmp, final)
        except OSError:  # another run renamed its identical copy first
            shutil.rmtree(tmp, ignore_errors=True)
        return final if (final / "config.json").is_file() else None
    except OSError:
        return None


class HFExportDir:
    """A temporary HF model directory that vLLM starts from and reloads weights from."""

    def __init__(self, hf_config, tie_word_embeddings: bool, dtype: torch.dtype, rank: int = 0,
                 weights_bytes: int = 0, host_copies: int = 1):
        # locked for this process's life: a killed rank's copy of the weights (RAM, in /dev/shm)
        # is removed by the next export directory made on the host. /dev/shm when it holds two
        # copies for each of the host's ``host_copies`` engines (each rank with vLLM has its own)
        self._dir = OwnedDir(f"rl-vllm-rank{rank}-", export_base(2 * weights_bytes * max(1, host_copies)),
                             family="rl-vllm-rank")
        self.path = self._dir.path
        self.tied = bool(tie_word_embeddings)
        self.dtype = dtype
        self.keys: set | None = None  # the tensor names of the first write; every sync must match
        hf_config.save_pretrained(self.path)

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE

    def write_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Write ``state_dict`` (HF names) as model.safetensors; returns bytes written.

        Tied models: ``lm_head.weight`` is dropped (it is the embedding; vLLM ignores it and
        safetensors refuses shared storage). Written to a temp name, then renamed, so vLLM
        never reads a half-written file.
        """
        from safetensors.torch import save_file

        out = {}
        for k, v in state_dict.items():
            if self.tied and k == "lm_head.weight":
                continue
            t = v.detach()
            if hasattr(t, "full_tensor"):  # a DTensor that slipped through
                t = t.full_tensor()
            t = t.to(device="cpu", dtype=self.dtype if t.is_floating_point() else t.dtype)
            out[k] = t.contiguous()
        keys = set(out)
        if not keys or (self.keys is not None and keys != self.keys):
            lost = sorted(self.keys - keys)[:5] if self.keys else []
            raise RuntimeError(
                f"the trainer's export_hf_state_dict() gave this rank {len(keys)} tensors"
                + (f" (missing {lost}...)" if lost else "") + "; the vLLM rollout needs the full weights on "
                "every rank (a full_state_dict gathered to rank 0 only is not enough)")
        self.keys = keys
        tmp = self.path / (WEIGHTS_FILE + ".tmp")
        size = sum(t.numel() * t.element_size() for t in out.values())
        try:
            if shutil.disk_usage(self.path).free < size:
                raise OSError(errno.ENOSPC, "No space left on device")
            save_file(out, str(tmp))
        except Exception as e:  # safetensors raises its own SafetensorError ("... (os error 28)")
            tmp.unlink(missing_ok=True)
            if getattr(e, "errno", None) != errno.ENOSPC and "os error 28" not in str(e):
                raise
            raise OSError(errno.ENOSPC, (
                f"no space left in {self.path.parent} for the vLLM rollout's copy of the weights ({size / 2**20:,.0f} "
                f"MiB, written beside the previous copy at every sync). Free space there, or point TMPDIR at a "
                f"directory with room for twice that per rank on this host (in a container, /dev/shm is 64 MiB "
                f"unless it was started with --shm-size or --ipc=host)")) from e
        os.replace(tmp, self.weights_path)
        return size

    def remove(self) -> None:
        self._dir.remove()


def _lm_head(model):
    return getattr(model, "lm_head", None)


def _kv_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _kv_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _kv_tensors(v)


class _QuietBufferOnlyLayers:
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning on every reload: the
    rotary cos/sin cache is a buffer no checkpoint holds, and vLLM keeps it (verified by
    verify_sync after each reload)."""

    def filter(self, record) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and "Rotary" in str(args[0]))


def _quiet_reload_logs() -> None:
    import logging

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _QuietBufferOnlyLayers) for f in log.filters):
        log.addFilter(_QuietBufferOnlyLayers())


class WeightSyncExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is the worker."""

    def rl_reload_weights(self, weights_dir: str, tied_embeddings: bool) -> dict:
        """Reload every weight in place from ``weights_dir`` (a directory of safetensors)."""
        t0 = time.perf_counter()
        _quiet_reload_logs()
        load = self.vllm_config.load_config
        if load.load_format == "dummy":  # started from start_dir without weights: every load reads safetensors
            load.load_format = "auto"
        model = self.model_runner.get_model()
        loaded: dict = {}
        load_weights = model.load_weights

        def recording(weights):  # vLLM's in-place reload only logs what it did not load
            loaded["names"] = load_weights(weights)
            return loaded["names"]

        model.load_weights = recording
        try:
            self.reload_weights(weights_path=weights_dir, is_checkpoint_format=True)
        finally:
            del model.load_weights
        missing = {n for n, _ in model.named_parameters()} - set(loaded.get("names") or ())
        if tied_embeddings:
            missing.discard("lm_head.weight")
        if missing:  # left as they were: random values after the start without weights
            raise RuntimeError(f"the exported weights in {weights_dir} lack {len(missing)} of vLLM's parameters "
                               f"({', '.join(sorted(missing)[:5])}); vLLM would sample with them unset")
        relinked = False
        if tied_embeddings:
            model = self.model_runner.get_model()
            head = _lm_head(model)
            if head is not None and hasattr(head, "quant_method"):
                embed = getattr(getattr(model, "model", model), "embed_tokens", None)
                if embed is not None and head.weight.data_ptr() != embed.weight.data_ptr():
                    with torch.no_grad():
                        head.weight.data.copy_(embed.weight.data)
                head.quant_method.process_weights_after_loading(head)
                relinked = True
        return {"seconds": time.perf_counter() - t0, "lm_head_reprocessed": relinked}

    def rl_kv_cache_bytes(self) -> int:
        """Bytes of the KV-cache tensors this worker allocated."""
        seen, total = set(), 0
        for t in _kv_tensors(getattr(self.model_runner, "kv_caches", [])):
            key = (t.untyped_storage().data_ptr(), t.device.type)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def rl_process_memory(self) -> dict:
        """This vLLM worker process: resident host bytes, and on CUDA its device bytes."""
        import psutil

        out = {"rss": int(psutil.Process().memory_info().rss)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda_allocated"] = int(torch.cuda.memory_allocated())
            out["cuda_reserved"] = int(torch.cuda.memory_reserved())
        return out

    def rl_plugin_on(self) -> bool:
        """Whether rl's vLLM plugin acts in this worker process (engine/rollout/vllm_plugin.py)."""
        from engine.rollout import vllm_plugin

        return vllm_plugin._registered

    def rl_weight_checksum(self, names: list[str]) -> dict:
        """Sum of each named parameter in vLLM's model (debugging a sync by hand)."""
        params = dict(self.model_runner.get_model().named_parameters())
        return {n: float(params[n].double().sum()) for n in names if n in params}
