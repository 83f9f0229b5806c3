"""Where the ranks' process group meets: rank 0's node address (as Ray reports it), on a port
chosen on that node, through a TCP store whose listening socket we bind ourselves.

``init_process_group(init_method="tcp://HOST:P")`` makes rank 0's store listen on ``*:P`` (all
interfaces) whatever HOST is. Instead rank 0 binds a socket to exactly its node address (127.0.0.1
for a local run) and hands it to ``TCPStore(master_listen_fd=...)``; the other ranks connect to it.
gloo's and NCCL's own sockets bind the address of the interface they pick: for a loopback node
that is forced to ``lo``; on a cluster it is the interface that holds the node's Ray address,
unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME were set by the user.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_address() -> str:
    """This process's node address as Ray reports it (127.0.0.1 on a local run, and outside
    Ray, where a RankWorker is driven directly by a test or benchmark)."""
    import ray

    if not ray.is_initialized():
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def open_store_socket(host: str) -> tuple[int, int]:
    """Bind a listening socket to ``host`` on a free port; returns (fd, port). The fd is handed
    to the TCP store, which owns it from then on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    port = sock.getsockname()[1]
    return sock.detach(), port


def interface_of(host: str) -> str | None:
    """Name of the network interface holding address ``host`` (None when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == host:
                return name
    return None


def pin_interfaces(host: str) -> dict[str, str]:
    """Point gloo and NCCL at the interface of ``host`` (this rank's node address). Loopback is
    always forced (a local run must not listen elsewhere); otherwise a user's setting wins."""
    iface = "lo" if is_loopback(host) else interface_of(host)
    out = {}
    for var in IFNAME_VARS:
        if iface and (is_loopback(host) or not os.environ.get(var)):
            os.environ[var] = iface
        if os.environ.get(var):
            out[var] = os.environ[var]
    return out


def make_store(host: str, port: int, rank: int, world_size: int, listen_fd: int | None, timeout_s: float):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=listen_fd)
    return dist.TCPStore(host, port, world_size, False, timeout=timeout)
