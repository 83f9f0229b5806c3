"""Where reward calls run: inline on the driver, in a watched thread (when a timeout is set),
or in a pool of spawned processes (``task.reward_workers=N``, pebble's ProcessPool).

Every executor takes a list of calls ``(target, batched, role, samples[, state])`` (the arguments
of ``fn``, by default engine/rewards/call.py's ``run_call``; the agent loop's tool calls pass their
own, engine/agents/tool_calls.py) and returns one outcome per call, in order: ``("ok", values)``, ``("err", message, where)`` or
``("timeout",)``. With ``stop_on_failure`` it stops at the first failure and leaves the
remaining outcomes ``None`` (the caller raises).

In the pool each call has its own timeout, counted from when a worker starts it: a hung call's
worker is killed and replaced (pebble), and the other calls in flight carry on in their own
workers, neither resent nor restarted. A hung call on the driver cannot be killed: its thread is
abandoned (a daemon thread, it does not keep the process alive), so prefer
``reward_workers>=1`` with a timeout for code that may hang.
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, wait

from engine.rewards.call import run_call

Call = tuple  # (target, batched, role, samples[, state])


def _failed(outcome) -> bool:
    return outcome is None or outcome[0] != "ok"


def run_inline(calls: list[Call], stop_on_failure: bool, fn=run_call) -> list:
    out: list = [None] * len(calls)
    for i, c in enumerate(calls):
        out[i] = fn(*c)
        if stop_on_failure and _failed(out[i]):
            break
    return out


def run_watched(calls: list[Call], timeout_s: float, stop_on_failure: bool, fn=run_call) -> list:
    """Calls in order on a daemon thread; a call that takes longer than ``timeout_s`` is
    abandoned (its outcome is a timeout) and a new thread takes the rest."""
    out: list = [None] * len(calls)
    i = 0
    while i < len(calls):
        results: queue.Queue = queue.Queue()
        start = i

        def work(first=start, q=results):
            for j in range(first, len(calls)):
                q.put((j, fn(*calls[j])))

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


def _pebble():
    try:
        import pebble
    except ImportError:
        from engine.errors import ConfigError

        raise ConfigError("task.reward_workers>=1 scores in a process pool that needs pebble, which is not "
                          "installed. Install it with `pip install 'rl[rewards]'`, or set task.reward_workers=0 "
                          "to score on the driver.", title="missing dependency") from None
    return pebble


def _outcome(future) -> tuple:
    """A finished call's outcome; the pool's own ways of ending one become outcomes too."""
    from concurrent.futures import CancelledError

    try:
        return future.result()
    except TimeoutError:  # pebble's per-call timeout: the worker was killed and replaced
        return ("timeout",)
    except CancelledError:
        return ("err", "the reward worker process died (stopped: the run is ending)", "")
    except _pebble().ProcessExpired as e:
        return ("err", f"the reward worker process died (exit code {e.exitcode}: killed, or crashed in native "
                       f"code)", "")
    except Exception as e:  # noqa: BLE001 - a sample that does not pickle, a broken pool
        return ("err", f"{type(e).__name__}: {e}", "")


class ProcessPool:
    """A pool of spawned worker processes kept for the whole run (pebble's ProcessPool): a call
    past its timeout has its own worker killed and replaced; the others are untouched."""

    POLL_S = 0.5  # how often a waiting run() looks for calls that close() cancelled

    def __init__(self, workers: int):
        _pebble()  # the missing-extra error at setup, not at the first step
        self.workers = workers
        self._pool = None
        self._inflight: set = set()

    def _ensure(self):
        if self._pool is None:
            self._pool = _pebble().ProcessPool(self.workers, context=multiprocessing.get_context("spawn"),
                                               initializer=_init_worker, initargs=(list(sys.path),))
        return self._pool

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the workers: idle ones exit; one still inside a call (a hung reward, an
        interrupted run) is killed after ``grace_s``, so closing never blocks on user code. A
        run() waiting on such a call gets an error outcome for it."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.close()
        try:
            pool.join(timeout=grace_s)
        except TimeoutError:
            for f in list(self._inflight):
                f.cancel()
            pool.stop()
            pool.join()

    def run(self, calls: list[Call], timeout_s: float, stop_on_failure: bool, fn=run_call) -> list:
        pool = self._ensure()
        out: list = [None] * len(calls)
        futures = [pool.schedule(fn, args=c, timeout=timeout_s or None) for c in calls]
        index = {f: i for i, f in enumerate(futures)}
        pending = set(futures)
        self._inflight |= pending
        try:
            while pending:
                wait(pending, timeout=self.POLL_S, return_when=FIRST_COMPLETED)
                done = [f for f in futures if f in pending and f.done()]  # in call order
                for f in done:
                    pending.discard(f)
                    i = index[f]
                    out[i] = _outcome(f)
                    if stop_on_failure and _failed(out[i]):
                        for g in pending:
                            g.cancel()  # not started: dropped; running: only its worker is killed
                        return out
            return out
        finally:
            self._inflight -= set(futures)
