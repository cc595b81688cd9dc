"""Free TCP ports for servers gyre-ray starts (Serve's HTTP proxy, SGLang, a Ray head, metrics).

A port the kernel hands out for `bind(("", 0))` lies in its ephemeral range, the same range every
outgoing connection draws its local port from: on a busy host (Ray opens hundreds of gRPC
connections) another process can take that port between the moment it is picked and the moment the
server binds it, and the server fails with "address already in use". The ports chosen here lie below
the ephemeral range and above Ray's worker ports (10002-19999), where no outgoing connection lands;
each is checked free by binding it before it is returned.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS = (10002, 19999)
LISTEN_RANGE_START = RAY_WORKER_PORTS[1] + 1
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_START = 32768
_ATTEMPTS = 200


def ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (32768 where the kernel does not say)."""
    try:
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


def is_free(host: str, port: int, reuse_port: bool = False) -> bool:
    """True when a TCP server could bind (host, port) now; `reuse_port`: one that sets SO_REUSEPORT,
    which may share the port with other such sockets of the same user (as Ray Serve's proxies do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse_port and hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and that no outgoing connection will take before it is bound."""
    end = ephemeral_start()
    if end - LISTEN_RANGE_START >= 1000:
        rng = random.SystemRandom()
        for _ in range(_ATTEMPTS):
            port = rng.randrange(LISTEN_RANGE_START, end)
            if is_free(host, port):
                return port
    # the kernel's range leaves no room below it (or all of that room is taken): let it choose
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
