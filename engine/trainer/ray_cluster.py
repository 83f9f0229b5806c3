"""Start (or join) Ray for a run: local clusters bind 127.0.0.1 only, no dashboard, and are
shut down on exit and on Ctrl-C. Every remote call goes through ``get`` with a timeout."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from engine.errors import UserError

# Without this, Ray binds the machine's network address even when given 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@contextmanager
def ray_cluster(address: str, num_cpus: int):
    import ray

    started = False
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # worker lines to a pipe or log: no ANSI colours
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=True,
                      configure_logging=True)
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)
        started = True
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def get(refs, timeout_s: float, what: str):
    """ray.get with a timeout that names what was being waited for."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise UserError(f"Timed out after {timeout_s:.0f}s waiting for {what}. A rank may be stuck or the "
                        f"machine overloaded; raise trainer.ray_timeout_s if the step is legitimately slow.",
                        title="ray timeout") from None
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, UserError):
            raise cause from None
        raise
    except RayActorError as e:
        raise UserError(f"A worker process died while {what}: {e}", title="worker died") from None
