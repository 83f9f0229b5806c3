"""Python's cyclic garbage collector around the ML stack's imports.

Importing torch, transformers and a backend creates ~400k long-lived objects (modules, functions,
classes, their dicts) and almost no garbage. The collector does not know that: while they are
created it runs ~900 young-generation passes and several full passes that find next to nothing,
and afterwards every full pass walks all of them again (~0.2 s each on a 2-core machine).
``imports_without_gc`` runs a block of imports with the collector paused, clears the block's own
cyclic leftovers with one young-generation pass, and moves everything alive into the collector's
permanent generation (``gc.freeze``, as vLLM and SGLang do after start-up): those objects are still
freed by reference counting, only no longer walked. Measured (docs/benchmarks.md, "Start-up"):
torch + transformers + FSDP2 + DCP imports 4.8-6.3 user CPU-s as usual, 3.5-4.0 s this way; a
rank's start-up 3.9-4.2 -> 3.0-3.5 CPU-s. Nothing in it changes what a run computes."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def imports_without_gc():
    """Pause the cyclic collector for the block (imports, nothing that makes garbage in a loop),
    then freeze what is alive and restore the collector as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(0)  # the block's few cyclic leftovers (~12k objects for torch + transformers), else frozen for good
        gc.freeze()
        if was_enabled:
            gc.enable()
