"""engine/import_gc.py: the ML stack's imports run without the cyclic collector's passes, and what
they created is frozen afterwards, so that no later full pass walks it; garbage made in the block
is still collected, and the collector is left as it was found."""

import gc
import subprocess
import sys

import pytest

from engine.import_gc import imports_without_gc
from tests.cli_utils import ROOT


@pytest.fixture
def fresh_gc():
    """Each test sees an unfrozen heap and leaves the collector enabled, as it found it."""
    gc.unfreeze()
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


class Node:
    def __init__(self):
        self.other = None


def test_no_pass_runs_in_the_block_and_its_objects_are_frozen_after(fresh_gc):
    passes = []
    gc.callbacks.append(lambda phase, info: passes.append(info["generation"]) if phase == "start" else None)
    try:
        gc.enable()
        with imports_without_gc():
            assert not gc.isenabled()
            kept = [Node() for _ in range(50_000)]  # more than enough to trigger young passes
            assert passes == []
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.callbacks.pop()


def test_a_cycle_dropped_in_the_block_is_collected_not_frozen(fresh_gc):
    import weakref

    with imports_without_gc():
        a, b = Node(), Node()
        a.other, b.other = b, a  # only the cyclic collector can free these
        alive = weakref.ref(a)
        del a, b
    assert alive() is None


def test_the_collector_is_restored_as_found_even_when_the_block_raises(fresh_gc):
    gc.disable()
    with imports_without_gc():
        pass
    assert not gc.isenabled()  # a caller that had paused it keeps it paused
    gc.enable()
    with pytest.raises(ImportError):
        with imports_without_gc():
            raise ImportError("no such module")
    assert gc.isenabled()


def test_a_rank_starts_with_torch_and_its_backend_frozen_and_the_collector_on():
    """RankWorker's start-up (engine/trainer/worker.py): after it, torch, transformers and the
    backend's modules are in the permanent generation, and a full collection walks almost nothing."""
    code = (
        "import gc, time\n"
        "from engine.config.load import load_run_config\n"
        "from engine.config.resolved import resolve_run\n"
        "from engine.trainer.worker import RankWorker\n"
        "RankWorker(resolve_run(load_run_config([]).config), 0, 1, 1)\n"
        "import sys; assert 'torch' in sys.modules and 'transformers.modeling_utils' in sys.modules\n"
        "t = time.perf_counter(); gc.collect(); full = time.perf_counter() - t\n"
        "print(gc.isenabled(), gc.get_freeze_count(), len(gc.get_objects()), full)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    enabled, frozen, tracked, _ = r.stdout.split()
    assert enabled == "True"
    assert int(frozen) > 100_000 and int(tracked) < int(frozen) / 10, r.stdout
