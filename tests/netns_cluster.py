"""A real two-host Ray cluster on one machine: two network namespaces joined by a veth pair
(10.231.0.1 and 10.231.0.2, addresses that exist only inside them), one Ray node in each,
started with `ip netns exec ... ray start`. The namespaces share the filesystem; host B can
get a private directory mounted over one path (its Ray runs in its own mount namespace) to
play a node that does not share that directory.

Token authentication is on (Ray's documented way: ``RAY_AUTH_MODE=token`` and the token in
``RAY_AUTH_TOKEN`` on every node and driver; docs/cluster.md): every command run on a host gets
both, unless a test passes other values (``env_extra``) to play a driver without the token.

Everything is created by the test and torn down in ``close()`` (always called from a fixture's
finally): the namespaces' processes are killed, the namespaces (and so the veth pair) deleted.
Root only; ``TwoHosts.create`` raises ``pytest.skip`` with the reason where namespaces cannot
be made."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.ray_procs import child_env, kill_all, processes_naming, wait_for

HEAD_IP, WORKER_IP, PORT = "10.231.0.1", "10.231.0.2", 6379
RAY_NODE_ARGS = ["--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"]


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


class TwoHosts:
    def __init__(self, private_view: Path | None = None, private_dir: Path | None = None, auth: bool = True):
        tag = str(os.getpid() % 100000)
        self.ns = {"A": f"rl{tag}a", "B": f"rl{tag}b"}
        self.veth = (f"rl{tag}va", f"rl{tag}vb")
        self.ip = {"A": HEAD_IP, "B": WORKER_IP}
        self.tmp = {h: Path(tempfile.mkdtemp(prefix=f"rln{h}", dir="/tmp")) for h in "AB"}
        self.private_view, self.private_dir = private_view, private_dir
        self.address = f"{HEAD_IP}:{PORT}"
        self.created: list[str] = []
        self.token = secrets.token_hex(16) if auth else ""

    # ---- namespaces -------------------------------------------------------------------
    def create(self) -> None:
        if os.geteuid() != 0:
            pytest.skip("the two-host test needs root to create network namespaces (ip netns add)")
        if shutil.which("ip") is None:
            pytest.skip("the two-host test needs iproute2 (`ip`) to create network namespaces")
        a, b = self.ns["A"], self.ns["B"]
        r = _ip("netns", "add", a, check=False)
        if r.returncode:
            pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
        self.created.append(a)
        _ip("netns", "add", b)
        self.created.append(b)
        va, vb = self.veth
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        _ip("-n", a, "addr", "add", f"{HEAD_IP}/24", "dev", va)
        _ip("-n", b, "addr", "add", f"{WORKER_IP}/24", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")

    def env(self, host: str, **extra) -> dict:
        """A host's environment: its own Ray temp dir, the cluster's auth settings (token mode
        and its token, or auth off); never the local-only Ray setting (it makes `ray start
        --address` refuse to join) nor an inherited RAY_ADDRESS or token file path."""
        auth = ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token} if self.token
                else {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": None})
        return child_env(**{"RAY_TMPDIR": str(self.tmp[host]), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": None,
                            "RAY_ADDRESS": None, "RAY_AUTH_TOKEN_PATH": None, **auth, **extra})

    def cmd(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def run(self, host: str, argv: list[str], timeout: float = 600, env_extra: dict | None = None,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(host, argv), env=self.env(host, **(env_extra or {})), capture_output=True,
                              text=True, timeout=timeout, **kw)

    def popen(self, host: str, argv: list[str], log: Path, **kw) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in the background, its output going to the file ``log``
        (never a pipe nobody reads while waiting: a full pipe would stall the run)."""
        with open(log, "w") as f:
            return subprocess.Popen(self.cmd(host, argv), env=self.env(host), stdout=f, stderr=subprocess.STDOUT,
                                    text=True, **kw)

    # ---- Ray nodes --------------------------------------------------------------------
    def start_head(self) -> None:
        r = self.run("A", ["ray", "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={PORT}",
                           "--include-dashboard=false", *RAY_NODE_ARGS], timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr

    def start_worker(self) -> None:
        join = ["ray", "start", f"--address={self.address}", f"--node-ip-address={WORKER_IP}", *RAY_NODE_ARGS]
        if self.private_view is not None:
            # host B sees its own private directory at private_view (a mount namespace of its own)
            script = (f'mount --bind "{self.private_dir}" "{self.private_view}" && exec '
                      + " ".join(f"'{a}'" for a in join))
            argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
        else:
            argv = join
        r = self.run("B", argv, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr

    def wait_nodes(self, n: int, timeout_s: float = 180) -> None:
        script = ("import ray, time, sys\n"
                  f"ray.init(address='{self.address}', logging_level='ERROR')\n"
                  f"end = time.monotonic() + {timeout_s}\n"
                  "while time.monotonic() < end:\n"
                  "    alive = [x for x in ray.nodes() if x['Alive']]\n"
                  f"    if len(alive) == {n}: sys.exit(0)\n"
                  "    time.sleep(1)\n"
                  "sys.exit(f'{len(alive)} nodes alive')\n")
        import sys

        r = self.run("A", [sys.executable, "-c", script], timeout=timeout_s + 60)
        assert r.returncode == 0, f"cluster did not reach {n} alive nodes: {r.stdout[-2000:]}{r.stderr[-2000:]}"

    def pids(self, host: str) -> list[int]:
        r = _ip("netns", "pids", self.ns[host], check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_host(self, host: str, timeout_s: float = 60) -> None:
        """SIGKILL every process inside the host's namespace (its Ray node and the ranks on it)."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not self.pids(host), timeout_s, f"host {host}'s processes to end")

    def close(self) -> None:
        for host in "AB":
            if self.ns[host] in self.created:
                try:
                    self.kill_host(host, timeout_s=30)
                except AssertionError:
                    pass
            kill_all(processes_naming(str(self.tmp[host])))
        for name in self.created:
            _ip("netns", "del", name, check=False)
        for t in self.tmp.values():
            shutil.rmtree(t, ignore_errors=True)
