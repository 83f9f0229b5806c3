"""Which classes implement each ``engine.name``: the one place a backend is registered.

Entries are import paths, so choosing a backend imports only that backend (megatron-core is
not imported by an FSDP2 run, and neither is imported by the driver)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class Backend:
    engine: str   # "module:Class" of its TrainEngine (engine/backends/base.py)
    critic: str   # "module:Class" of its PPO critic (engine/backends/critic.py)
    preload: tuple[str, ...] = ()  # modules a rank may import early, while the driver starts up


BACKENDS: dict[str, Backend] = {
    "fsdp": Backend("engine.backends.fsdp.engine:FSDPEngine", "engine.backends.fsdp.critic:FSDPCritic",
                    preload=("torch.distributed.fsdp",)),
    "megatron": Backend("engine.backends.megatron.engine:MegatronEngine",
                        "engine.backends.megatron.critic:MegatronCritic"),
}


def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(import_module(module), name)


def engine_class(name: str):
    """The TrainEngine subclass of backend ``name`` (a key of BACKENDS; the schema checks it)."""
    return _load(BACKENDS[name].engine)


def critic_class(name: str):
    """The critic class of backend ``name``."""
    return _load(BACKENDS[name].critic)
