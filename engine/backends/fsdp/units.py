"""What FSDP2 wraps and how: the decoder blocks of any transformers model, the unit choice
(``engine.fsdp_unit``), gradient sync per micro-batch, compiled blocks and the CPU matmul
library. Shared by the policy (engine.py) and the critic (critic.py)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of any transformers model, found by class: the model's
    ``_no_split_modules`` names them (LlamaDecoderLayer, GPT2Block, GPTNeoXLayer, ...). Works
    through wrappers (PEFT) because it walks every submodule. Empty when the model does not
    declare them: the caller then shards the root only."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    if not names:
        return []
    # by MRO: fully_shard swaps a module's class for an FSDP subclass of it
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    # a declared class may also appear nested inside another declared one: keep the outermost
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]


def fsdp_units(engine_cfg, world_size: int, device: torch.device, dtype: str = "float32") -> str:
    """What ``engine.fsdp_unit`` wraps in FSDP2 on this run: ``layer`` (every decoder layer its
    own unit), ``model`` (one unit: one gather a pass instead of one a layer) or ``none`` (no
    FSDP2: the plain model). On one rank there is nothing to shard or reduce, and FSDP2's
    gather copies, hooks and DTensor dispatch are all cost: 5-20% of an update and the whole
    gathered copy of the weights at the issue-17 shape on a CPU (docs/benchmarks.md), so
    ``auto`` takes ``none`` on a one-rank CPU run of a float32 model (``model``, one unit, for a
    low-precision one: FSDP2's mixed-precision policy is what casts its compute copy). On GPUs
    and across ranks layers bound what is gathered at once. ``check_fsdp_units`` refuses an
    explicit ``none`` where FSDP2 is needed."""
    unit = getattr(engine_cfg, "fsdp_unit", "layer")
    if unit == "auto":
        if world_size == 1 and device.type == "cpu":
            return "none" if dtype == "float32" else "model"
        return "layer"
    return unit


def check_fsdp_units(units: str, world_size: int, dtype: str) -> None:
    """A clear error for ``engine.fsdp_unit=none`` where FSDP2 is needed."""
    from engine.errors import ConfigError

    if units != "none":
        return
    if world_size > 1:
        raise ConfigError(f"engine.fsdp_unit=none runs the plain model on one rank, but this run has {world_size} "
                          f"ranks, which FSDP2 shards over. Use engine.fsdp_unit=auto (or layer/model), or one rank.",
                          title="invalid config value")
    if dtype != "float32":
        raise ConfigError(f"engine.fsdp_unit=none keeps the parameters as they are, but model.dtype={dtype} computes "
                          f"in a low-precision copy that FSDP2's mixed-precision policy makes. Use engine.fsdp_unit=auto "
                          f"(or model/layer), or model.dtype=float32.", title="invalid config value")


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync`` (reduce gradients on this backward or not); a
    plain model (``engine.fsdp_unit=none``) has nothing to reduce."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def compile_decoder_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` the forward of every decoder block (engine.compile), as torchtitan and
    torchtune do under FSDP2: the root's forward and the hooks fully_shard puts around each block
    (gather before, free after, gradient reduction) stay eager, so a block computes on gathered
    weights. Compiling the root forward instead bypassed the root's hooks and handed the blocks
    sharded weights (a DTensor/tensor mix dynamo refused). One compiled graph serves every block
    of a model (their code is the same; parameters are inputs). Returns how many were compiled."""
    import torch._dynamo.config as dynamo_config

    # dynamic=False: each (rows, length) a micro-batch has, in each grad mode, is its own graph
    # (pad_to_length bounds how many); dynamo's default of 8 graphs per frame would then run every
    # further shape eagerly for the rest of the run, with one log line
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
    blocks = decoder_blocks(model)
    for block in blocks:
        block._rl_eager_forward = block.forward
        block.forward = torch.compile(block.forward, dynamic=False)
    return len(blocks)


def use_cpu_matmul(engine_cfg, device: torch.device, *models) -> int:
    """Route the linear layers of ``models`` (None skipped) through oneDNN when
    ``engine.cpu_matmul`` resolves to it on ``device`` (engine/model/onednn_linear.py); returns
    how many layers were swapped (0: torch's own ``F.linear``)."""
    from engine.model.onednn_linear import resolve, use_onednn_linears

    if resolve(getattr(engine_cfg, "cpu_matmul", "aten"), device) != "onednn":
        return 0
    return sum(use_onednn_linears(m) for m in models if m is not None)


@contextmanager
def eager_decoder_blocks(model: torch.nn.Module):
    """The blocks' own (uncompiled) forwards inside the block: generation feeds them a new shape
    at every token, which a ``dynamic=False`` graph would recompile for (then give up on)."""
    swapped = [(b, b.forward) for b in decoder_blocks(model) if hasattr(b, "_rl_eager_forward")]
    for b, _ in swapped:
        b.forward = b._rl_eager_forward
    try:
        yield model
    finally:
        for b, compiled in swapped:
            b.forward = compiled
