# Passive OpenMP waiting before torch loads its OpenMP runtime (engine/threads.py says why).
from engine.threads import apply_process_defaults as _apply_thread_defaults

_apply_thread_defaults()
