"""Loopback ports for servers that are restarted on the same address.

A server started on port 0 gets a port from the kernel's ephemeral range, the range it also
hands out as the source port of every outgoing connection on the machine. Once that server is
SIGKILLed, its port is free for any of them, and its replacement (started closed on the same
address, as Kubernetes restarts a pod) then fails to listen: the demo's self-healing run
failed that way on a busy machine. A port below the ephemeral range is never handed out
implicitly, so only a process that asks for that very port can take it.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST_PORT = 10000
"""Below it live the well-known services a developer machine runs (databases, caches, 8000s)."""

LINUX_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_START = 32768
"""Linux's default start; macOS starts at 49152, so this is below it as well."""


def ephemeral_start() -> int:
    """The first port the kernel hands out implicitly."""
    try:
        start = int(LINUX_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START
    return start if start > LOWEST_PORT + 1000 else DEFAULT_EPHEMERAL_START


def restartable_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports below the ephemeral range, free on `host` a moment ago. They are
    bound together (so they differ) and released for the servers to bind; chosen at random, so
    that processes choosing at the same moment rarely probe the same one (and a port bound
    meanwhile is skipped)."""
    candidates = list(range(LOWEST_PORT, ephemeral_start()))
    random.shuffle(candidates)
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in candidates:
            probe = stack.enter_context(socket.socket())
            try:
                probe.bind((host, port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise OSError(f"no {count} free ports on {host} below {ephemeral_start()}")


def restartable_addresses(count: int, host: str = "127.0.0.1") -> list[str]:
    return [f"{host}:{port}" for port in restartable_ports(count, host)]
