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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.fleet import ports
from rollout_checkpoint.client.fleet.ports import (
    LOWEST_PORT,
    ephemeral_range,
    ephemeral_start,
    in_ephemeral_range,
    restartable_ports,
)
from rollout_checkpoint.examples.demo import fleet as demo_fleet
from rollout_checkpoint.examples.demo.fleet import start_fleet
from rollout_checkpoint.examples.demo.options import Options

from .s3_server import free_ports


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
        found = [ports.port_of(a) for a in pair]
        assert all(p is not None and p < ephemeral_start() for p in found), (name, pair)


def test_the_address_in_use_exit_is_the_clis() -> None:
    assert ports.ADDRESS_IN_USE_EXIT == ExitCode.ADDRESS_IN_USE


@pytest.fixture
def taken() -> Iterator[str]:
    """An address another process listens on (this test, on a kernel-chosen port)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield f"127.0.0.1:{held.getsockname()[1]}"


def choosing(
    taken: str, hand_out_taken: Callable[[int], bool]
) -> tuple[Callable[[int], list[str]], list[list[str]]]:
    """A `restartable_addresses` that hands out `taken` as the first address of the n-th
    choice when `hand_out_taken(n)`, and what it handed out."""
    handed: list[list[str]] = []

    def choose(count: int) -> list[str]:
        chosen = ports.restartable_addresses(count)
        if hand_out_taken(len(handed)):
            chosen = [taken, *chosen[1:]]
        handed.append(chosen)
        return chosen

    return choose, handed


async def test_a_member_whose_address_was_taken_meanwhile_starts_on_fresh_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: str
) -> None:
    """Chosen free, a port can be taken before the server binds it (another process chose
    it at that moment): a member given a taken port starts again on fresh addresses rather
    than failing the fleet. Every other choice hands out the taken port (three servers start
    at once)."""
    choose, handed = choosing(taken, lambda number: number % 2 == 0)
    monkeypatch.setattr(demo_fleet, "restartable_addresses", choose)
    fleet = await start_fleet("ports", tmp_path, "token", Options(), start_closed=True)
    try:
        addresses = {n: (s.http, s.grpc) for n, s in fleet.servers.items()}
    finally:
        fleet.kill()
    assert len(addresses) == 5 and all(http != taken for http, _ in addresses.values())
    assert sum(1 for chosen in handed if chosen[0] == taken) >= 3, handed


def test_a_taken_address_is_told_from_other_start_failures() -> None:
    check = "rollout-checkpoint serve: cannot listen on HTTP address 127.0.0.1:18565: in use"
    bind = "ERROR uvicorn.error: [Errno 98] error while attempting to bind on address "
    bind += "('127.0.0.1', 18565): address already in use"
    assert ports.address_was_taken(8, "")
    assert ports.address_was_taken(1, f"starting\n{check}\n")
    assert ports.address_was_taken(3, f"a\n{bind}\nb")
    assert not ports.address_was_taken(2, "rollout-checkpoint serve: --token is required")
    assert not ports.address_was_taken(None, "cannot listen on HTTP address x:1: Permission denied")


def test_a_restartable_counter_whose_address_was_taken_starts_on_fresh_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: str
) -> None:
    """The supervisor tests' counters choose their addresses the same way (and again)."""
    from . import test_supervisor

    choose, handed = choosing(taken, lambda number: number == 0)
    monkeypatch.setattr(test_supervisor, "restartable_addresses", choose)
    counters = test_supervisor.CounterFleet(tmp_path)
    try:
        member = counters.start("c0")
    finally:
        counters.stop()
    assert len(handed) == 2 and member.http == handed[1][0] != taken
