"""Where reward calls run: inline on the driver, in a watched thread (when a timeout is set),
or in a pool of spawned processes (``task.reward_workers=N``).

Every executor takes a list of calls ``(target, batched, role, samples)`` and returns one
outcome per call, in order: ``("ok", values)``, ``("err", message, where)`` or
``("timeout",)``. With ``stop_on_failure`` it stops at the first failure and leaves the
remaining outcomes ``None`` (the caller raises).

A hung call in the pool is ended by killing the pool's processes (a fresh pool replaces them;
other in-flight calls are resubmitted). A hung call on the driver cannot be killed: its thread
is abandoned (a daemon thread, it does not keep the process alive), so prefer
``reward_workers>=1`` with a timeout for code that may hang.
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Optional

from engine.rewards.call import run_call

Call = tuple  # (target, batched, role, samples)


def _failed(outcome) -> bool:
    return outcome is None or outcome[0] != "ok"


def run_inline(calls: list[Call], stop_on_failure: bool) -> list:
    out: list = [None] * len(calls)
    for i, c in enumerate(calls):
        out[i] = run_call(*c)
        if stop_on_failure and _failed(out[i]):
            break
    return out


def run_watched(calls: list[Call], timeout_s: float, stop_on_failure: bool) -> list:
    """Calls in order on a daemon thread; a call that takes longer than ``timeout_s`` is
    abandoned (its outcome is a timeout) and a new thread takes the rest."""
    out: list = [None] * len(calls)
    i = 0
    while i < len(calls):
        results: queue.Queue = queue.Queue()
        start = i

        def work(first=start, q=results):
            for j in range(first, len(calls)):
                q.put((j, run_call(*calls[j])))

        threading.Thread(target=work, daemon=True, name="reward-call").start()
        while i < len(calls):
            try:
                j, outcome = results.get(timeout=timeout_s)
            except queue.Empty:
                out[i] = ("timeout",)
                i += 1
                break  # that thread is stuck in call i: start a new one after it
            out[j] = outcome
            i = j + 1
            if stop_on_failure and _failed(outcome):
                return out
        if stop_on_failure and i > 0 and _failed(out[i - 1]):
            return out
    return out


def _init_worker(path: list[str]) -> None:
    sys.path[:] = path


def _reap(p, timeout_s: float) -> None:
    """Wait until ``p`` has exited and its exit code is known. The pool's own manager thread
    reaps its workers too: when it wins that race, ``p.join`` returns with the exit code still
    unset (``is_alive()`` says True for a dead process) until the manager thread records it."""
    deadline = time.monotonic() + timeout_s
    p.join(timeout=timeout_s)
    while p.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)


class ProcessPool:
    """A spawned process pool kept for the whole run; per-call timeouts kill and replace it."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool: Optional[ProcessPoolExecutor] = None

    def _ensure(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(list(sys.path),))
            # start every worker now, so the first calls' timeouts do not include process start-up
            for f in [self._pool.submit(time.sleep, 0.05) for _ in range(2 * self.workers)]:
                f.result()
        return self._pool

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list(getattr(pool, "_processes", {}).values())  # no public API to kill workers before 3.14
        for p in procs:
            p.kill()
        pool.shutdown(wait=True, cancel_futures=True)
        for p in procs:
            _reap(p, timeout_s=5)

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the workers: idle ones exit; one still inside a call (a hung reward, an
        interrupted run) is killed after ``grace_s``, so closing never blocks on user code."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                _reap(p, timeout_s=5)

    def run(self, calls: list[Call], timeout_s: float, stop_on_failure: bool) -> list:
        out: list = [None] * len(calls)
        pending = list(range(len(calls)))[::-1]        # stack of calls not yet submitted
        inflight: dict[Future, tuple[int, float]] = {}  # future -> (call index, deadline)
        while pending or inflight:
            pool = self._ensure()
            while pending and len(inflight) < self.workers:  # at most one call per worker: a call starts when sent
                i = pending.pop()
                deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
                inflight[pool.submit(run_call, *calls[i])] = (i, deadline)
            wait_s = min(d for _, d in inflight.values()) - time.monotonic()
            done, _ = wait(list(inflight), timeout=None if wait_s == float("inf") else max(wait_s, 0),
                           return_when=FIRST_COMPLETED)
            broken = False
            for f in done:
                i, _ = inflight.pop(f)
                try:
                    out[i] = f.result()
                except BrokenProcessPool:
                    out[i] = ("err", "the reward worker process died (killed, or crashed in native code)", "")
                    broken = True
                if stop_on_failure and _failed(out[i]):
                    self._kill()
                    return out
            now = time.monotonic()
            late = [(f, i) for f, (i, d) in inflight.items() if d <= now and not f.done()]
            if late or broken:
                for f, i in late:
                    out[i] = ("timeout",)
                    del inflight[f]
                if stop_on_failure and late:
                    self._kill()
                    return out
                # the pool's processes are stuck or gone: replace them, resend what was in flight
                pending += [i for i, _ in inflight.values()]
                inflight.clear()
                self._kill()
        return out
