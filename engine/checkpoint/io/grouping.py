"""Which group an entry belongs to: model, optimizer state, optimizer param groups, rng,
scheduler, data (or other), judged from its name.

`rl` checkpoints name things exactly (docs/checkpoint-format.md), so :func:`rl_group` is a
prefix table; foreign formats get :func:`guess_group`, which knows the conventions of
torch's flattened optimizer state dicts, Megatron and verl.
"""

from __future__ import annotations

import re

_RL_PREFIXES = (
    ("model.", "model"),
    ("critic.model.", "critic model"),            # algorithm=ppo (engine/backends/fsdp/critic.py)
    ("critic.optim.state.", "critic optimizer state"),
    ("critic.optim.param_groups.", "critic optimizer param groups"),
    ("optim.state.", "optimizer state"),
    ("optim.param_groups.", "optimizer param groups"),
    ("rng.", "rng"),
    ("scheduler.", "scheduler"),
    ("data.", "data"),
)


def rl_group(name: str, is_tensor: bool = False) -> str:
    """Group of an entry of an `rl` checkpoint (names as in docs/checkpoint-format.md).

    ``is_tensor`` is accepted for a common signature with :func:`guess_group`; unused.
    """
    for prefix, group in _RL_PREFIXES:
        if name.startswith(prefix):
            return group
    return "other"


_SPLIT = re.compile(r"[./]")
_OPTIM_WORDS = {"optim", "optimizer", "optimizers", "optim_state", "optimizer_state"}
_STATE_WORDS = {"exp_avg", "exp_avg_sq", "momentum_buffer", "fp32_param", "max_exp_avg_sq",
                "fp32_from_fp16_params", "state"}


def guess_group(name: str, is_tensor: bool = False) -> str:
    """Best guess at the group of an entry of a foreign checkpoint, from its name.

    A tensor that matches no rule counts as model; any other entry as other.
    """
    parts = [p.lower() for p in _SPLIT.split(name) if p]
    if not parts:
        return "other"
    if "param_groups" in parts:
        return "optimizer param groups"
    if parts[0] in _OPTIM_WORDS or (parts[0] == "state" and len(parts) > 2):
        return "optimizer state"
    if any(p in ("exp_avg", "exp_avg_sq", "momentum_buffer") for p in parts):
        return "optimizer state"
    first = parts[0]
    if "rng" in first or first in ("random", "rng_state", "cuda_rng_state", "np_rng_state"):
        return "rng"
    if "scheduler" in first:
        return "scheduler"
    if first in ("data", "dataloader", "data_loader", "sampler", "consumed_samples"):
        return "data"
    if first in ("model", "module", "state_dict", "model_state_dict") or is_tensor:
        return "model"
    return "other"
