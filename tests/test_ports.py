"""Ports for servers lie outside the kernel's ephemeral range and Ray's worker ports, and are free."""

from __future__ import annotations

import socket

from gyre_ray.ports import LISTEN_RANGE_START, RAY_WORKER_PORTS, ephemeral_start, free_port


def test_free_ports_avoid_the_ephemeral_range_and_rays_worker_ports() -> None:
    ports = {free_port() for _ in range(50)}
    start = ephemeral_start()
    assert all(LISTEN_RANGE_START <= port < start for port in ports), sorted(ports)
    assert not any(RAY_WORKER_PORTS[0] <= port <= RAY_WORKER_PORTS[1] for port in ports)
    assert len(ports) > 40  # drawn at random, so two servers rarely race for one port


def test_a_port_in_use_is_never_returned() -> None:
    taken = []
    try:
        for _ in range(20):
            port = free_port()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", port))  # raises if free_port handed out a port in use
            sock.listen()
            taken.append(sock)
        assert len({s.getsockname()[1] for s in taken}) == 20
    finally:
        for sock in taken:
            sock.close()
