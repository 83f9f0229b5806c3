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


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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


def check_device_config(cfg) -> None:
    """Refuse (ConfigError, exit 2) a config this machine cannot run: trainer.device=cuda without
    CUDA, engine.fp8 without Transformer-Engine on an sm >= 8.9 GPU. Kept out of engine.config
    (which never imports torch) and run before anything starts."""
    from engine.errors import ConfigError

    if cfg.trainer.device == "cuda" and not cuda_available():
        raise ConfigError("`trainer.device=cuda` but no CUDA device is visible on this machine. "
                          "Use trainer.device=auto (or cpu).", title="invalid config value")
    if cfg.engine.fp8:
        reason = fp8_unavailable_reason()
        if reason:
            raise ConfigError(f"`engine.fp8=true` needs Transformer-Engine on an FP8-capable GPU: {reason}. "
                              f"Drop engine.fp8 (bf16/fp32 train fine).", title="invalid config value")
