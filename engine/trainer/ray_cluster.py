"""Start a private Ray for a local run, or join a cluster when asked; every remote call goes
through ``get`` with a timeout.

Which Ray a run uses (decided by ``resolve_address``, said in the run's plan):
- ``trainer.ray_address=""`` and no ``RAY_ADDRESS`` in the environment: a private local Ray
  (``ray.init(address="local")``), never whatever cluster /tmp/ray/ray_current_cluster records.
- ``trainer.ray_address=""`` and ``RAY_ADDRESS`` set: that cluster is joined (honoured, as in a
  ``ray job submit -- rl train ...`` entrypoint, where Ray sets it). ``trainer.ray_address=local``
  forces a private Ray even then.
- ``trainer.ray_address=auto|host:6379|ray://host:10001``: joins that cluster.

A local Ray binds 127.0.0.1 only: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read by Ray when it is
imported, and by every Ray process it starts) makes Ray's servers listen on loopback. That
setting makes ``ray start --address`` refuse to join a cluster, so it is set only for local runs
(and clusters at a loopback address, which live on this machine) and removed from the
environment of a driver that joins a cluster at a network address. A watchdog (``ray_reaper.py``)
ends the local Ray's processes if the driver dies without shutting it down (SIGKILL).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError
from engine.sigterm import TERMINATED_EXIT, sigterm_as_exit

LOCAL_ONLY_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@dataclass(frozen=True)
class RayTarget:
    address: str      # "" = a private local Ray; otherwise what ray.init(address=...) gets
    source: str       # "local", "trainer.ray_address" or "RAY_ADDRESS"

    @property
    def local(self) -> bool:
        return not self.address

    @property
    def loopback(self) -> bool:
        """A private Ray, or a cluster whose address is on this machine's loopback (one machine:
        keep Ray on 127.0.0.1; joining it with the setting removed would make Ray rewrite
        127.0.0.1 to the machine's network address)."""
        if self.local:
            return True
        address = self.address
        if address == "auto":
            from ray._common.utils import get_ray_address_file  # noqa: PLC0415 - only when joining

            try:
                address = Path(get_ray_address_file(None)).read_text().strip()
            except OSError:
                return False
        host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host == "localhost"

    def describe(self) -> str:
        if self.local:
            return "private local Ray on 127.0.0.1"
        return f"Ray cluster at {self.address} (from {self.source})"


def resolve_address(configured: str, environ=os.environ) -> RayTarget:
    """Which Ray the run uses: see the module docstring."""
    configured = configured.strip()
    if configured == "local":
        return RayTarget("", "local")
    if configured:
        return RayTarget(configured, "trainer.ray_address")
    env = environ.get("RAY_ADDRESS", "").strip()
    if env and env != "local":
        return RayTarget(env, "RAY_ADDRESS")
    return RayTarget("", "local")


def ranks_elsewhere(ray_address: str, environ=os.environ) -> bool:
    """The run joins a Ray cluster that is not on this machine: its ranks' hardware is theirs,
    not the driver's (engine/device.py check_device_config)."""
    return not resolve_address(ray_address, environ).loopback


def _set_local_only(local: bool) -> None:
    """Local runs (and clusters on loopback): Ray binds loopback (set before Ray is imported;
    also patched into an already-imported Ray, whose constant was read at import). Drivers
    joining a cluster of several machines: unset."""
    if local:
        os.environ[LOCAL_ONLY_VAR] = "0"
    elif os.environ.get(LOCAL_ONLY_VAR) == "0":
        del os.environ[LOCAL_ONLY_VAR]
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = not local


def wait_reachable(target: RayTarget, timeout_s: float, poll_s: float = 1.0) -> None:
    """Before joining a cluster at ``host:port`` (or ``ray://host:port``): wait until that address
    accepts a TCP connection, at most ``timeout_s`` (trainer.ray_connect_timeout_s); then a
    UserError naming the address and what was tried. ``ray.init`` itself has no bound: with nothing
    listening it retried without end. ``auto`` (an address file on this machine) is left to Ray."""
    import socket

    address = target.address.split("://")[-1]
    if target.local or target.address == "auto" or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    try:
        port_n = int(port)
    except ValueError:
        return  # not host:port: Ray's own message says what is wrong with it
    deadline = time.monotonic() + timeout_s
    tries, last = 0, None
    while True:
        tries += 1
        try:
            with socket.create_connection((host, port_n), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
        if time.monotonic() + poll_s >= deadline:
            break
        time.sleep(poll_s)
    raise UserError(f"Could not reach the {target.describe()}: {tries} TCP connection attempt(s) to {host}:{port_n} "
                    f"over {timeout_s:g} s failed ({getattr(last, 'strerror', None) or last}). Check that the cluster "
                    f"is running there (`ray status --address {target.address}`) and reachable from this machine, "
                    f"raise trainer.ray_connect_timeout_s if it is still starting, or leave trainer.ray_address empty "
                    f"(and RAY_ADDRESS unset) for a local run.", title="ray cluster")


@contextmanager
def ray_cluster(address: str, num_cpus: int, connect_timeout_s: float = 60.0):
    """Yield ``(ray, target)`` with Ray started (local) or joined (cluster, its address reachable
    within ``connect_timeout_s``); on exit, shut down what this call started."""
    target = resolve_address(address)
    wait_reachable(target, connect_timeout_s)
    _set_local_only(target.loopback)
    if target.local:  # the private Ray: no token auth (a joined cluster's: the user's env, engine/trainer/ray_auth.py)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    started, reaper = False, None
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # worker lines to a pipe or log: no ANSI colours
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        with sigterm_as_exit():  # (ray.init puts in its own handler, which exits 15, until it returns)
            started, reaper = _start(ray, target, num_cpus, connect_timeout_s)
    except SystemExit as e:  # SIGTERM while Ray starts: Ray's own handler exits 15; the same stop as later
        if e.code not in (signal.SIGTERM, TERMINATED_EXIT):
            raise
        if ray.is_initialized():
            ray.shutdown()
        raise SystemExit(TERMINATED_EXIT) from None
    try:
        with sigterm_as_exit():  # a kill stops workers and Ray as Ctrl-C does (not Ray's stack dump)
            yield ray, target
    finally:
        if started:
            if target.local:
                _end_autoscaler_monitor(ray)
            ray.shutdown()
        if reaper is not None:
            reaper.release()


def _start(ray, target, num_cpus: int, connect_timeout_s: float):
    """Start (local) or join Ray unless this process already has; returns (started, reaper)."""
    started, reaper = False, None
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=True, configure_logging=True)
        if target.local:
            saved = os.environ.pop("RAY_ADDRESS", None)  # never inherited by the private Ray's processes
            try:
                t0 = time.time()
                # no prestarted idle workers: every rank is an actor with its own runtime_env (its
                # thread settings), which Ray never gives to a prestarted worker, so they only cost
                # start-up CPU (~0.8 CPU-s a run on the 2-core machine)
                # worker_niceness 0: ranks at the driver's own priority, not Ray's default 15, under
                # which any ordinary process on a busy machine takes the CPU first (engine/threads.py)
                # task_events_max_num_task_in_gcs: the GCS keeps a record of every task for Ray's
                # state API (`ray list tasks`), up to 100,000 by default: a run's GCS grew ~16 MiB per
                # 1,000 steps until then (bench/soak.py); rl reads none of them, and the last 1,000
                # tasks are still there for debugging
                ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1",
                         _system_config={"prestart_worker_first_driver": False, "worker_niceness": 0,
                                         "task_events_max_num_task_in_gcs": 1000}, **kwargs)
            finally:
                if saved is not None:
                    os.environ["RAY_ADDRESS"] = saved
            reaper = start_reaper(ray, since=t0)
        else:
            from ray.exceptions import AuthenticationError

            from engine.trainer.ray_auth import auth_error, check_cluster_accepts_driver, check_token_settings

            check_token_settings(target.address)
            check_cluster_accepts_driver(target.address, connect_timeout_s)  # a refused token: exit 2 at once
            try:
                ray.init(address=target.address, **kwargs)
            except AuthenticationError:
                raise auth_error(target.address) from None
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise UserError(f"Could not join the {target.describe()}: {e}. Check that the cluster is "
                                f"running (`ray status --address ...`) and reachable from this machine, or "
                                f"leave trainer.ray_address empty (and RAY_ADDRESS unset) for a local run.",
                                title="ray cluster") from None
        started = True
    return started, reaper


def _local_raylets(ray) -> list:
    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    return [i for i in (getattr(node, "all_processes", None) or {}).get("raylet", [])
            if getattr(i, "process", None) is not None]


def owns_local_ray(ray) -> bool:
    """Whether this process started the Ray it is connected to (the private local Ray, which
    ``ray.shutdown()`` ends whole), not joined a cluster."""
    return bool(_local_raylets(ray))


def local_raylet_gone(ray) -> bool:
    """Whether this process started a private Ray whose raylet has exited: then no Ray call will
    get an answer."""
    return any(i.process.poll() is not None for i in _local_raylets(ray))


def _end_autoscaler_monitor(ray) -> None:
    """Kill the private Ray's autoscaler monitor before ``ray.shutdown()``. Shutdown stops Ray's
    processes one at a time, each with SIGTERM and up to 1 s to exit; the monitor never exits on
    SIGTERM, so it costs every run a full second (1.35 s -> 0.35 s of shutdown, measured). A
    private cluster has a fixed size and nothing to autoscale, so ending it at once loses nothing."""
    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    for info in (getattr(node, "all_processes", None) or {}).get("monitor", []):
        proc = getattr(info, "process", None)
        if proc is None:
            continue
        try:
            proc.kill()
            proc.wait(timeout=5)
        except Exception:  # already gone, or not ours to wait on: ray.shutdown() handles the rest
            pass


class Reaper:
    """Handle on the watchdog process: closing our end of its pipe tells it the driver is done."""

    def __init__(self, proc: subprocess.Popen, write_fd: int):
        self.proc, self.write_fd = proc, write_fd

    def release(self, wait_s: float = 30.0) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


def start_reaper(ray, since: float) -> Reaper | None:
    """Start the watchdog for the local Ray session just started (see ray_reaper.py)."""
    node = getattr(ray._private.worker, "_global_node", None)
    session_dir = node.get_session_dir_path() if node is not None else ""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("ray_reaper.py")), str(os.getpid()), str(read_fd),
             session_dir, repr(since)],
            pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return None
    os.close(read_fd)
    return Reaper(proc, write_fd)


def timeout_error(timeout_s: float, what: str) -> UserError:
    return UserError(f"Timed out after {timeout_s:.0f}s waiting for {what}. A rank may be stuck or the machine "
                     f"overloaded; raise trainer.ray_timeout_s if the step is legitimately slow.", title="ray timeout")


def get(refs, timeout_s: float, what: str):
    """ray.get with a timeout that names what was being waited for."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise timeout_error(timeout_s, what) from None
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, UserError):
            raise cause from None
        raise
    except RayActorError as e:
        raise WorkerLost(what, str(e)) from None


class WorkerLost(UserError):
    """An actor's process died mid-call (not bad input: exit 1, no traceback). ``detail`` keeps
    Ray's text (the trainer reads it for a kill for memory); the message is one paragraph."""

    exit_code = 1

    def __init__(self, what: str, detail: str, after: str = ""):
        import re

        self.what, self.detail, self.after = what, detail, after
        found = [(label, re.search(rf"{key}: (\S+)", detail)) for label, key in
                 (("", "class_name"), ("pid ", "pid"), ("exit type ", "Worker exit type"))]
        who = ", ".join(label + m.group(1) for label, m in found if m)
        super().__init__(f"A worker process ({who or 'a Ray actor'}) died while rl waited for {what}. A signal, "
                         f"the kernel's OOM killer or a crash in native code ends a process this way. {after}".rstrip(),
                         title="worker died")

    def __reduce__(self):
        return (WorkerLost, (self.what, self.detail, self.after))
