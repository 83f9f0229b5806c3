"""Safe readers of checkpoint files: regular files only, bounded JSON, DCP metadata, and a
restricted unpickler that never runs what it reads. The runtime (restore, verify, resume plans,
model sources) and the offline tools (engine/inspect, engine/export) both read through them."""
