"""All of rl's behaviour (docs/architecture.md). Importing it changes nothing in the process:
settings that belong to a process (OpenMP's waiting policy, before torch loads its runtime:
engine/threads.py ``apply_process_defaults``) are applied where a process starts (the `rl`
command, a benchmark's main, the test session), and passed on to the processes they spawn."""
