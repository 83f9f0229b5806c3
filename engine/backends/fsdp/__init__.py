"""The FSDP2 backend: engine.py (the policy), critic.py (the PPO value model), units.py (what
fully_shard wraps, gradient sync, compiled blocks)."""

from engine.backends.fsdp.engine import FSDPEngine
from engine.backends.fsdp.units import check_fsdp_units, decoder_blocks, fsdp_units, set_gradient_sync

__all__ = ["FSDPEngine", "check_fsdp_units", "decoder_blocks", "fsdp_units", "set_gradient_sync"]
