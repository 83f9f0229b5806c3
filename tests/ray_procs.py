"""Helpers for tests that start real Ray processes and `rl train` subprocesses: find them,
wait on observed events (never a bare sleep), and end exactly what a test started (never
`ray stop`, which ends every Ray on the machine, other people's included)."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def rl_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "rlcli.main", *args]


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(REPO))
    env["OMP_NUM_THREADS"] = "1"
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def plain(text: str) -> str:
    """CLI output without rich's box drawing and line wrapping: one space between words."""
    for ch in "│╭╮╰╯─┃":
        text = text.replace(ch, " ")
    return " ".join(text.split())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a.is_loopback


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None, poll_s: float = 0.5):
    """Poll ``predicate`` until truthy; fail naming ``what`` after ``timeout_s`` or when
    ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = predicate()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process exited ({proc.returncode}) before {what}:\n{out[-4000:]}")
        time.sleep(poll_s)
    out = ""
    if proc is not None:  # show what the process printed, so a hang says where it was
        proc.kill()
        out = "\n" + (proc.communicate(timeout=30)[0] or "")[-4000:] if proc.stdout else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{out}")


def metrics_rows(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def processes_naming(text: str) -> list[psutil.Process]:
    """Processes whose command line mentions ``text`` (e.g. a test's private Ray temp dir),
    with all their descendants (Ray's agents rename themselves and do not mention it)."""
    found = {}
    me = psutil.Process()
    mine = {me.pid} | {p.pid for p in me.parents()}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid not in mine and any(text in a for a in (p.info["cmdline"] or [])):
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
        except psutil.Error:
            pass
    return list(found.values())


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def kill_all(procs: list[psutil.Process], grace_s: float = 5.0, kill_wait_s: float | None = None) -> None:
    """SIGTERM, ``grace_s`` to exit, then SIGKILL for the rest and up to ``kill_wait_s`` (default
    ``grace_s``) for them to be gone."""
    for p in alive(procs):
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive(procs), timeout=grace_s)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive(procs), timeout=grace_s if kill_wait_s is None else kill_wait_s)


class LoopbackHead:
    """A real `ray start --head` on 127.0.0.1 with its own RAY_TMPDIR (short: Ray's socket
    paths must fit 107 bytes) and its Ray client server on a free port (not 10001, which
    another Ray may hold). ``stop()`` ends exactly its processes: those naming its temp dir and
    those naming its address (the client server names only that), never `ray stop`; then
    removes the temp dir."""

    def __init__(self, prefix: str, num_cpus: int, env: dict, *extra: str):
        self.tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.address = f"127.0.0.1:{free_port()}"
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        self.started = subprocess.run(
            [ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.address.split(':')[1]}",
             f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
             f"--ray-client-server-port={free_port()}", *extra],
            env={**env, "RAY_TMPDIR": str(self.tmp)}, capture_output=True, text=True, timeout=180)

    def stop(self) -> None:
        # a short grace: the raylet and the agents end on SIGTERM at once, but the GCS server and
        # one Ray Python process outlast any grace (measured: still there after 8 s), so a 5 s
        # grace only waited, at every head's teardown; the SIGKILL that follows ends them
        kill_all(processes_naming(str(self.tmp)) + processes_naming(self.address), grace_s=1.0, kill_wait_s=10.0)
        shutil.rmtree(self.tmp, ignore_errors=True)
