"""Watchdog for a local Ray session: when the driver is gone, end every process of its session.

Ray's kernel fate-sharing (PR_SET_PDEATHSIG) takes the GCS and raylet down with the driver,
but the dashboard and runtime-env agents are the raylet's children and outlive it (measured:
still running 30 s after the driver was SIGKILLed). This script runs as its own process (its
own session, so a Ctrl-C in the terminal does not end it first), started by ray_cluster.py
right after ``ray.init``:

    python ray_reaper.py DRIVER_PID PIPE_FD SESSION_DIR SINCE

It notes the driver's Ray descendants started since SINCE (epoch seconds) every half second. When
the pipe closes (the driver exited, however it died, or released it after ``ray.shutdown``)
or the driver's pid is gone, it sends SIGTERM to every noted process still alive (same pid
and start time) and to any process whose command line names SESSION_DIR, then SIGKILL to what
is left after 3 s. Standalone on purpose: it imports only psutil.
"""

from __future__ import annotations

import os
import select
import signal
import sys

import psutil


RAY_PATH = os.sep + "ray" + os.sep


def is_ray_process(p: psutil.Process, session_dir: str) -> bool:
    """Ray's workers and agents rename themselves ``ray::...``; its servers run from the ray package."""
    cmd = p.cmdline()
    return p.name().startswith("ray::") or any(a.startswith("ray::") or RAY_PATH in a or
                                               (session_dir and session_dir in a) for a in cmd)


def session_processes(driver: psutil.Process, since: float, session_dir: str, me: int) -> dict[int, float]:
    out = {}
    try:
        kids = driver.children(recursive=True)
    except psutil.Error:
        return out
    for p in kids:
        try:
            if p.pid != me and p.create_time() >= since - 1 and is_ray_process(p, session_dir):
                out[p.pid] = p.create_time()
        except psutil.Error:
            pass
    return out


def named_in_cmdline(session_dir: str, me: int) -> dict[int, float]:
    out = {}
    if not session_dir:
        return out
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            if p.pid != me and any(session_dir in a for a in (p.info["cmdline"] or [])):
                out[p.pid] = p.info["create_time"]
        except psutil.Error:
            pass
    return out


def end_all(noted: dict[int, float], grace_s: float = 3.0) -> None:
    alive = []
    for pid, created in noted.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3:
                p.send_signal(signal.SIGTERM)
                alive.append(p)
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass


def main(argv: list[str]) -> None:
    driver_pid, fd, session_dir, since = int(argv[0]), int(argv[1]), argv[2], float(argv[3])
    me = os.getpid()
    try:
        driver = psutil.Process(driver_pid)
    except psutil.Error:
        return
    noted: dict[int, float] = {}
    while True:
        noted.update(session_processes(driver, since, session_dir, me))
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready and not os.read(fd, 64):
            break  # EOF: the driver closed its end or died
        if not driver.is_running():
            break
    noted.update(named_in_cmdline(session_dir, me))
    end_all(noted)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    main(sys.argv[1:])
