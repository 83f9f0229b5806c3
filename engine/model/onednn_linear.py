"""Linear layers through oneDNN's fp32 GEMM on a CPU (``engine.cpu_matmul``).

PyTorch's CPU build multiplies fp32 matrices with MKL (``F.linear``, ``torch.mm``). MKL picks its
kernels by CPU vendor: on AMD processors it runs its AVX2 code even where the CPU has AVX-512
(Zen 4, Zen 5), which halves the matmul rate. oneDNN, which the same PyTorch build ships (it is
what inductor calls for CPU linears), picks its kernels by the instructions the CPU has. Measured
on a 2-core AMD EPYC (Zen 5, AVX-512), 2 threads, fp32 (docs/benchmarks.md, issue 17):

| shape (rows x in x out) | MKL (``F.linear``) | oneDNN |
|---|---|---|
| 1024 x 1024 x 1024 | 212 GFLOP/s | 453 GFLOP/s |
| 2048 x 256 x 768 (an update's q/k/v) | 212 | 459 |
| 64 x 256 x 768 (a decode step's q/k/v) | 176 | 348 |

Same fp32 arithmetic (FMA, fp32 accumulation; no reduced precision): the results differ from
MKL's only in summation order (~1e-7 relative).

``OneDNNLinear`` is ``F.linear`` as an autograd function whose forward and both backward
products (input and weight gradients) are oneDNN matmuls; ``use_onednn_linears`` swaps it into
every plain ``nn.Linear`` of a model per instance (a LoRA layer's base linear included). It
applies only where it is exact and supported: fp32 tensors on a CPU, under no tracing;
anything else -- a CUDA tensor, a DTensor, float64, ``torch.compile`` -- calls ``F.linear``.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

CHOICES = ("auto", "onednn", "aten")
# fp32 only: bf16/fp16 matmuls on a CPU already go through oneDNN in torch's own kernels
_DTYPES = (torch.float32,)
# where oneDNN's fp32 GEMM is JIT-generated for the instruction set; elsewhere (aarch64: ACL or
# reference kernels) torch's own BLAS stays the default
_X86 = ("x86_64", "amd64", "x64")


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op (every x86/aarch64 CPU wheel does)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def cpu_vendor() -> str:
    """The x86 CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...) from /proc/cpuinfo;
    '' where it cannot be read (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# x86 vendors whose CPUs MKL serves its generic AVX2 code even when they have AVX-512
_MKL_HANDICAPPED = ("AuthenticAMD", "HygonGenuine")


def resolve(choice: str, device: torch.device) -> str:
    """``engine.cpu_matmul`` for this process: ``onednn`` or ``aten``. ``auto`` is oneDNN on an
    AMD (or Hygon) x86 CPU whenever the build has it: MKL dispatches by vendor and runs its AVX2
    code there (oneDNN: 2x MKL's matmul rate on a Zen 5, 1.2-1.3x the update). On Intel CPUs MKL
    runs its AVX-512 code and oneDNN measured slower (a Xeon with AVX-512: rollout 0.86x, update
    0.89x at fixed shapes) and, with ragged batches, every new shape adds primitives to oneDNN's
    cache (the default job's rank held +360 MiB of host memory), so ``auto`` keeps torch's own
    GEMM there, as on accelerators, other CPUs and unknown vendors (docs/benchmarks.md)."""
    if choice not in CHOICES:
        raise ValueError(f"engine.cpu_matmul must be one of {', '.join(CHOICES)}, not {choice!r}")
    if device.type != "cpu" or choice == "aten":
        return "aten"
    if choice == "auto" and (platform.machine().lower() not in _X86 or cpu_vendor() not in _MKL_HANDICAPPED):
        return "aten"
    if not onednn_available():
        if choice == "onednn":
            raise RuntimeError("engine.cpu_matmul=onednn, but this torch build has no oneDNN (mkldnn): "
                               "use engine.cpu_matmul=aten or a torch CPU wheel")
        return "aten"
    return "onednn"


def onednn_matmul(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [rows, in] @ weight [out, in]^T (+ bias) by oneDNN: [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's blocked layout for products of about ``rows``
    rows, for a weight that many calls multiply by unchanged (a rollout's decode steps):
    ``onednn_matmul`` then skips re-packing it on every call (1.15-1.25x at a decode lane's 32
    rows, 1 thread; the same results bit for bit from 5 rows up, ~1e-6 relative below, where
    oneDNN takes a vector kernel). An opaque tensor: only ``onednn_matmul`` reads it. Returns
    ``weight`` itself where this torch cannot reorder it."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or weight.dtype not in _DTYPES or weight.device.type != "cpu":
        return weight
    try:
        return reorder(weight.detach().contiguous(), max(1, int(rows)))
    except RuntimeError:
        return weight


class OneDNNLinear(torch.autograd.Function):
    """y = x @ W^T + b, each product by oneDNN: forward x W^T, backward dy W (input) and dy^T x
    (weight). Saves what ``F.linear`` saves (the input and the weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return onednn_matmul(x2, weight, bias).view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dy [rows, out] @ W [out, in]: W^T as the [in, out] "weight"
            dx = onednn_matmul(dy2, weight.t(), None).view(*dy.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:  # dy^T [out, rows] @ x [rows, in], the wider side as the "weight"
            out_f, in_f = weight.shape
            if in_f >= out_f:  # (1.2-1.6x faster than the other way round, 2 threads, 1984 rows)
                dw = onednn_matmul(dy2.t(), x2.t(), None)
            else:
                dw = onednn_matmul(x2.t(), dy2.t(), None).t().contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype not in _DTYPES or weight.dtype != x.dtype or x.dim() < 1:
        return False
    if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
        return False  # a DTensor or another tensor subclass: its own dispatch
    if type(weight) is not torch.Tensor and not isinstance(weight, torch.nn.Parameter):
        return False
    if x.numel() == 0 or torch.compiler.is_compiling():
        return False
    return True


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN where it applies (see the module doc), else
    ``F.linear`` itself."""
    if not _applies(x, weight) or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return OneDNNLinear.apply(x, weight, bias)
    lead = x.shape[:-1]
    return onednn_matmul(x.reshape(-1, x.shape[-1]), weight, bias).view(*lead, weight.shape[0])


def _forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, module.weight, module.bias)
    return forward


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route every plain ``nn.Linear`` of ``model`` (exact class: a LoRA wrapper keeps its own
    forward, its base and adapter linears get this one) through ``onednn_linear``, per instance.
    Works before or after FSDP2's ``fully_shard`` (it reads ``module.weight`` at call time, so
    it sees the gathered weight). Returns how many were swapped."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not getattr(module, "_rl_onednn", False):
            module.forward = _forward(module)
            module._rl_onednn = True
            n += 1
    return n
