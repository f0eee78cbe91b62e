"""Ports for servers that are restarted on the same address.

A server started on port 0 gets a port from the kernel's ephemeral range, the range it also
hands out as the source port of every outgoing connection on the machine. Once that server is
SIGKILLed, its port is free for any of them, and its replacement (started closed on the same
address, as Kubernetes restarts a pod) then fails to listen: the demo's self-healing run
failed that way on a busy machine. A port below the ephemeral range is never handed out
implicitly, so only a process that asks for that very port can take it. The demo's fleet and
the tests' restartable servers take their ports here; `certify`, which restarts the user's
members on the addresses of their fleet file, notes a port inside the range.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST_PORT = 10000
"""Below it live the well-known services a developer machine runs (databases, caches, 8000s)."""

ADDRESS_IN_USE_EXIT = 8
"""`rollout-checkpoint serve`'s exit code for an address it cannot listen on."""

LINUX_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 65535)
"""Where the kernel's range cannot be read: Linux's default start (macOS starts at 49152, so
this is below it as well) up to the last port."""


def ephemeral_range() -> tuple[int, int]:
    """The first and last port the kernel hands out implicitly."""
    try:
        start, end = (int(word) for word in LINUX_EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    if not LOWEST_PORT + 1000 < start <= end:
        return DEFAULT_EPHEMERAL_RANGE  # too little room below it: use the default's
    return start, end


def ephemeral_start() -> int:
    return ephemeral_range()[0]


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


def port_of(address: str) -> int | None:
    """The port of `HOST:PORT` (IPv6 `[::1]:PORT` too); None when there is none."""
    _, colon, port = address.rpartition(":")
    return int(port) if colon and port.isdigit() else None


def in_ephemeral_range(address: str) -> bool:
    """Whether `address` listens on a port the kernel may hand out implicitly."""
    port = port_of(address)
    start, end = ephemeral_range()
    return port is not None and start <= port <= end


def address_was_taken(exit_code: int | None, log_text: str) -> bool:
    """Whether a server that exited before it announced itself lost its address to another
    process between `restartable_ports` and its own bind: `serve`'s own check says so with
    exit 8 (`ADDRESS_IN_USE`) and a `cannot listen on ...: in use` line, a bind that lost
    the race after that check with `address already in use` in its log."""
    return exit_code == ADDRESS_IN_USE_EXIT or any(
        "address already in use" in line
        or ("cannot listen on" in line and line.endswith(": in use"))
        for line in log_text.splitlines()
    )
