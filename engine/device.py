"""Which device a rank computes on, and what the hardware can do."""

from __future__ import annotations

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> cuda:<local_rank> when CUDA is present, else cpu."""
    if requested == "cuda" or (requested == "auto" and cuda_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def fp8_unavailable_reason() -> str:
    """'' when Transformer-Engine FP8 can run here, else why not."""
    if not cuda_available():
        return "no CUDA device on this machine"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"the GPU has compute capability {major}.{minor}; FP8 needs 8.9 (Ada) or newer"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "transformer_engine is not installed (pip install transformer-engine[pytorch])"
    return ""
