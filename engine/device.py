"""Which device a rank computes on, and what the hardware can do.

torch is imported where a function needs it: the driver's preflight calls ``check_device_config``
before it has loaded torch, and a CPU config needs none of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> cuda:<local_rank> when CUDA is present, else cpu."""
    import torch

    if requested == "cuda" or (requested == "auto" and cuda_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def assigned_cuda_index(assigned: list[str], visible_env: str | None, fallback: int) -> int:
    """The CUDA index of the one GPU Ray assigned this process (``ray.get_gpu_ids()``), as this
    process numbers its visible devices: its position in ``CUDA_VISIBLE_DEVICES`` (Ray normally
    sets that to the assigned GPU alone: index 0), or the physical id when nothing restricts
    visibility (a cluster that tells Ray not to set it). ``fallback`` when Ray assigned no single
    GPU."""
    if len(assigned) != 1:
        return fallback
    visible = [v.strip() for v in (visible_env or "").split(",") if v.strip()]
    if visible:
        return visible.index(assigned[0]) if assigned[0] in visible else fallback
    return int(assigned[0]) if assigned[0].isdigit() else fallback


def dist_backend(device: torch.device) -> str:
    """The process group's backends: NCCL for CUDA tensors and gloo for host tensors on a GPU.
    The ranks agree on small host-side counts (micro-batches, token totals, which rows to skip)
    with collectives on CPU tensors, which an NCCL-only group refuses ("No backend type
    associated with device type cpu") at the first step of any multi-GPU run."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def fp8_unavailable_reason() -> str:
    """'' when Transformer-Engine FP8 can run here, else why not."""
    if not cuda_available():
        return "no CUDA device on this machine"
    import torch

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"the GPU has compute capability {major}.{minor}; FP8 needs 8.9 (Ada) or newer"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "transformer_engine is not installed (pip install transformer-engine[pytorch])"
    return ""


def compile_unavailable_reason(on_cuda: bool) -> str:
    """'' when torch.compile's inductor can generate kernels here, else why not: on a CPU it
    compiles C++ (a C++ compiler, ``$CXX`` or g++/clang++/c++), on a GPU Triton kernels."""
    import importlib.util
    import os
    import shutil

    if on_cuda:
        return "" if importlib.util.find_spec("triton") else "triton is not installed (pip install triton)"
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    if any(shutil.which(n) for n in names):
        return ""
    return f"no C++ compiler on PATH (looked for {', '.join(names)}); install one, e.g. apt install g++"


def check_device_config(cfg, ranks_elsewhere: bool = False) -> None:
    """Refuse (ConfigError, exit 2) a config this machine cannot run: trainer.device=cuda without
    CUDA, engine.fp8 without Transformer-Engine on an sm >= 8.9 GPU. Kept out of engine.config
    (which never imports torch) and run before anything starts.
    ``ranks_elsewhere``: the run joins a Ray cluster on other machines, whose hardware is not this
    driver's (a CPU-only head node driving GPU workers): the checks of this machine's CUDA, kernel
    compilers and FP8 are left to the ranks, which fail on their own machines if they must."""
    from engine.errors import ConfigError

    if ranks_elsewhere:
        return
    if cfg.trainer.device == "cuda" and not cuda_available():
        raise ConfigError("`trainer.device=cuda` but no CUDA device is visible on this machine. "
                          "Use trainer.device=auto (or cpu).", title="invalid config value")
    if getattr(cfg.rollout, "cuda_graphs", False) and cfg.rollout.name == "torch":
        on_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and cuda_available())
        if not on_cuda:
            raise ConfigError("`rollout.cuda_graphs=true` captures the decode step as CUDA graphs, which needs a "
                              "GPU, and this run samples on the CPU. Set rollout.cuda_graphs=false (the CPU "
                              "decode path is already built for a CPU), or run with trainer.device=cuda on a GPU.",
                              title="invalid config value")
    kernels = [k for k in ("compile", "fused_kernels") if getattr(cfg.engine, k, False)]
    if kernels and cfg.engine.name == "fsdp":
        on_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and cuda_available())
        reason = compile_unavailable_reason(on_cuda)
        if reason:
            keys = " and ".join(f"`engine.{k}=true`" for k in kernels)
            raise ConfigError(f"{keys} {'needs' if len(kernels) == 1 else 'need'} torch.compile to generate "
                              f"kernels, which cannot run here: {reason}. "
                              f"Install it, or set {', '.join(f'engine.{k}=false' for k in kernels)}.",
                              title="invalid config value")
    if getattr(cfg.engine, "cpu_matmul", "auto") == "onednn":
        from engine.model.onednn_linear import onednn_available

        if not onednn_available():
            raise ConfigError("`engine.cpu_matmul=onednn` but this torch build has no oneDNN (mkldnn). "
                              "Use engine.cpu_matmul=auto (or aten), or a torch CPU wheel, which ships it.",
                              title="invalid config value")
    if cfg.engine.fp8:
        reason = fp8_unavailable_reason()
        if reason:
            raise ConfigError(f"`engine.fp8=true` needs Transformer-Engine on an FP8-capable GPU: {reason}. "
                              f"Drop engine.fp8 (bf16/fp32 train fine).", title="invalid config value")
