"""Servers that are restarted on their address listen below the ephemeral range.

A fleet member on a port from the ephemeral range, once SIGKILLed, leaves that port to any
outgoing connection on the machine; its replacement (closed, on the same address) then could
not listen. It happened in a full run: the supervisor's recovery never came, since the
replacement never started. The demo's fleet (which `--self-heal`, `collect` and several tests
replace members of) and the tests' own restartable servers take their ports from
`client/fleet/ports.py` instead.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rollout_checkpoint.client.fleet import ports
from rollout_checkpoint.client.fleet.ports import (
    LOWEST_PORT,
    ephemeral_range,
    ephemeral_start,
    in_ephemeral_range,
    restartable_ports,
)
from rollout_checkpoint.examples.demo.fleet import start_fleet
from rollout_checkpoint.examples.demo.options import Options

from .s3_server import free_ports


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_restartable_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = restartable_ports(8)
    assert len(set(ports)) == 8
    assert all(LOWEST_PORT <= port < ephemeral_start() for port in ports), ports
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free: nothing kept it


def test_a_port_in_use_is_never_chosen() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert taken not in restartable_ports(50)


def test_the_tests_free_ports_are_restartable_ones() -> None:
    assert all(port < ephemeral_start() for port in free_ports(4))


def test_the_ephemeral_range_is_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ports.LINUX_EPHEMERAL_RANGE.exists():
        pytest.skip("not Linux")
    start, end = (int(w) for w in ports.LINUX_EPHEMERAL_RANGE.read_text().split())
    assert ephemeral_range() == (start, end)
    assert in_ephemeral_range(f"127.0.0.1:{start}") and in_ephemeral_range(f"[::1]:{end}")
    assert not in_ephemeral_range(f"127.0.0.1:{start - 1}")
    assert not in_ephemeral_range("127.0.0.1") and not in_ephemeral_range("unix:/tmp/x")
    monkeypatch.setattr(ports, "LINUX_EPHEMERAL_RANGE", Path("/nonexistent/range"))
    assert ephemeral_range() == ports.DEFAULT_EPHEMERAL_RANGE


async def test_every_demo_fleet_member_listens_below_the_ephemeral_range(tmp_path: Path) -> None:
    fleet = await start_fleet("ports", tmp_path, "token", Options(), start_closed=True)
    try:
        addresses = {n: (s.http, s.grpc) for n, s in fleet.servers.items()}
    finally:
        fleet.kill()
    assert len(addresses) == 5
    for name, pair in addresses.items():
        assert all(port_of(a) < ephemeral_start() for a in pair), (name, pair)
