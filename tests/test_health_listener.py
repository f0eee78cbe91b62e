"""The plaintext health-only listener (`health_address`, `serve`/`coordinator --health-address`).

The kubelet's native `grpc:` probe speaks plaintext only; with TLS on the control port the
manifests had to exec a Python probe for every probe. Here, with TLS on the control port and
the health listener on 127.0.0.1:0: Check, Watch and List answer over plaintext on the health
port, from the very servicer of the control port (readiness follows a start-closed pod's
resume, and graceful shutdown turns every name NOT_SERVING there too); ParticipantService,
CoordinatorService and reflection answer UNIMPLEMENTED there, with or without a token; hostile
bytes get the typed refusal of the control port; nothing is bound unless it is configured;
the CLI announces it as `health`, checks its address before starting, and names it when it
is taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pydantic import ValidationError

from rollout_checkpoint.client.coordinator.service import SERVICE_NAME as COORDINATOR_SERVICE
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.serve import worker_command
from rollout_checkpoint.server.core.rpc.health_listener import MAX_REQUEST_BYTES
from rollout_checkpoint.server.core.rpc.tls import server_credentials
from rollout_checkpoint.server.runtime.health import LIVENESS, READINESS
from rollout_checkpoint.server.runtime.servicer import SERVICE_NAME as PARTICIPANT_SERVICE
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import participant_service_pb2_grpc as pb_grpc

from .conftest import TOKEN, Harness, start_harness, stop_harness
from .processes import started
from .test_health import NOT_SERVING, SERVING, check, killed_at_exit, watching
from .test_standard_services_hostile import (
    GARBAGE,
    HEALTH,
    assert_typed_invalid_request,
    send_raw,
)
from .tls_files import self_signed

METADATA = (("authorization", f"Bearer {TOKEN}"),)
PARTICIPANT_NAMES = ("", PARTICIPANT_SERVICE, LIVENESS, READINESS)
CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
WAIT = 30.0


# -- helpers --------------------------------------------------------------------------------


def _listening_ports() -> set[int]:
    """TCP ports this process listens on: its own sockets' inodes in /proc/net/tcp{,6}."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # an fd closed while listing
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    ports = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def listening_ports() -> set[int]:
    return await asyncio.to_thread(_listening_ports)


def port_of(address: str | None) -> int:
    assert address is not None
    return int(address.rsplit(":", 1)[1])


async def health_list(address: str) -> dict[str, int]:
    async with aio.insecure_channel(address) as channel:
        listed = await health_pb2_grpc.HealthStub(channel).List(
            health_pb2.HealthListRequest(), timeout=WAIT
        )
    return {name: int(reply.status) for name, reply in listed.statuses.items()}


async def unimplemented(call: Any) -> None:
    with pytest.raises(aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, caught.value


async def reflected_services(channel: aio.Channel) -> set[str]:
    """The services reflection lists over `channel`."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=WAIT)]
    return {s.name for r in replies for s in r.list_services_response.service}


@contextlib.asynccontextmanager
async def tls_sidecar(tmp_path: Path, **settings: Any) -> AsyncIterator[Harness]:
    """A real sidecar whose control port has TLS (the self-signed localhost certificate)."""
    key, cert = self_signed(tmp_path)
    h = await start_harness(tls_cert_file=str(cert), tls_key_file=str(key), **settings)
    try:
        yield h
    finally:
        await stop_harness(h)


def tls_client(h: Harness, tmp_path: Path) -> ParticipantClient:
    credentials = grpc.ssl_channel_credentials((tmp_path / "cert.pem").read_bytes())
    return ParticipantClient(
        f"localhost:{h.runtime.port}", TOKEN, credentials=credentials, clock=h.clock.now
    )


# -- the participant's sidecar ---------------------------------------------------------------


async def test_health_answers_in_plaintext_beside_tls_and_follows_the_participant(
    tmp_path: Path,
) -> None:
    async with tls_sidecar(tmp_path, start_closed=True, health_address="127.0.0.1:0") as h:
        health = h.runtime.health_address
        assert health is not None and health.startswith("127.0.0.1:")
        assert port_of(health) not in (0, h.runtime.port)
        # The control port is TLS only: plaintext gets nothing there.
        with pytest.raises(aio.AioRpcError):
            await check(h.grpc_address, LIVENESS)
        async with tls_client(h, tmp_path) as client, watching(health, *PARTICIPANT_NAMES) as w:
            # A start-closed pod: alive, not ready until it is resumed.
            await w[READINESS].until(NOT_SERVING)
            for name in ("", PARTICIPANT_SERVICE, LIVENESS):
                await w[name].until(SERVING)
            assert await check(health, READINESS) == NOT_SERVING
            assert await health_list(health) == {
                "": SERVING,
                PARTICIPANT_SERVICE: SERVING,
                LIVENESS: SERVING,
                READINESS: NOT_SERVING,
            }
            await client.resume("boot-1", h.deadline())
            await w[READINESS].until(SERVING)
            assert await check(health, READINESS) == SERVING
            # A pause past the readiness threshold, seen on the health port as on the other.
            await client.prepare_until_final("c1", h.deadline())
            h.clock.advance(31)
            await w[READINESS].until(NOT_SERVING)
            await client.resume("c1", h.deadline())
            await w[READINESS].until(SERVING)
            assert w[READINESS].seen == [NOT_SERVING, SERVING, NOT_SERVING, SERVING]
            assert w[LIVENESS].seen == [SERVING]
            # Graceful shutdown: every name NOT_SERVING on the health port at once...
            await h.runtime.sidecar.begin_shutdown()
            for name in PARTICIPANT_NAMES:
                await w[name].until(NOT_SERVING)
            assert set((await health_list(health)).values()) == {NOT_SERVING}
        # ...and the listener stops with the sidecar.
        await h.runtime.stop()
        assert port_of(health) not in await listening_ports()
        with pytest.raises(aio.AioRpcError) as gone:
            await check(health, "")
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_health_port_serves_health_and_nothing_else(tmp_path: Path) -> None:
    async with tls_sidecar(tmp_path, reflection=True, health_address="127.0.0.1:0") as h:
        health = h.runtime.health_address
        assert health is not None
        async with aio.insecure_channel(health) as channel:
            participant = pb_grpc.ParticipantServiceStub(channel)
            request = pb.GetParticipantRequest()
            # With the right token or none: the control service is not there at all.
            await unimplemented(
                participant.GetParticipant(request, metadata=METADATA, timeout=WAIT)
            )
            await unimplemented(participant.GetParticipant(request, timeout=WAIT))
            coordinator = cpb_grpc.CoordinatorServiceStub(channel)
            await unimplemented(
                coordinator.ListParticipants(cpb.ListParticipantsRequest(), timeout=WAIT)
            )
            # Hostile bytes: the control port's typed refusal, not UNKNOWN.
            for method in ("Check", "Watch", "List"):
                assert_typed_invalid_request(await send_raw(channel, HEALTH + method, GARBAGE[0]))
            # A health request is a name: a big one is refused before it is read.
            huge = health_pb2.HealthCheckRequest(service="x" * MAX_REQUEST_BYTES)
            with pytest.raises(aio.AioRpcError) as too_big:
                await health_pb2_grpc.HealthStub(channel).Check(huge, timeout=WAIT)
            assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Reflection is on for the control port, and still absent here.
            await unimplemented(reflected_services(channel))
        credentials = grpc.ssl_channel_credentials((tmp_path / "cert.pem").read_bytes())
        async with aio.secure_channel(f"localhost:{h.runtime.port}", credentials) as secure:
            assert PARTICIPANT_SERVICE in await reflected_services(secure)
        # Health itself still answers after all that.
        assert await check(health, LIVENESS) == SERVING


async def test_the_sidecar_binds_no_health_port_unless_configured(tmp_path: Path) -> None:
    before = await listening_ports()
    h = await start_harness()
    try:
        assert h.runtime.health_address is None and h.runtime.sidecar.health_listener is None
        http = port_of(str(h.http.base_url).rstrip("/"))
        assert await listening_ports() - before == {http, h.runtime.port}
    finally:
        await stop_harness(h)
    h = await start_harness(health_address="127.0.0.1:0")
    try:
        http = port_of(str(h.http.base_url).rstrip("/"))
        health = port_of(h.runtime.health_address)
        assert await listening_ports() - before == {http, h.runtime.port, health}
    finally:
        await stop_harness(h)


def test_the_health_address_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CheckpointSettings(enabled=True, token=TOKEN).health_address is None
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_HEALTH_ADDRESS", "0.0.0.0:9001")
    assert CheckpointSettings(enabled=True, token=TOKEN).health_address == "0.0.0.0:9001"
    monkeypatch.delenv("ROLLOUT_CHECKPOINT_HEALTH_ADDRESS")
    refused = {
        "9001": "HOST:PORT",
        "localhost:nine": "HOST:PORT",
    }
    for address, message in refused.items():
        with pytest.raises(ValidationError, match=message):
            CheckpointSettings(enabled=True, token=TOKEN, health_address=address)
    # The sidecar's own port number, on any host, could never be the health port.
    for health in ("0.0.0.0:9000", "127.0.0.1:9000"):
        with pytest.raises(ValidationError, match="port of its own"):
            CheckpointSettings(
                enabled=True, token=TOKEN, grpc_address="0.0.0.0:9000", health_address=health
            )
    both_free = CheckpointSettings(
        enabled=True, token=TOKEN, grpc_address="127.0.0.1:0", health_address="127.0.0.1:0"
    )
    assert both_free.health_address == "127.0.0.1:0"


# -- the coordinator ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def tls_coordinator(tmp_path: Path, **options: Any) -> AsyncIterator[Coordinator]:
    key, cert = self_signed(tmp_path)
    # Discovery is lazy: the coordinator serves (and answers health) before any member does.
    spec = FleetSpec(members=(MemberSpec("counter", "127.0.0.1:9"),), token=TOKEN)
    server = Coordinator(
        spec, "127.0.0.1:0", credentials=server_credentials(cert, key, None), **options
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_the_coordinator_serves_health_alone_in_plaintext_beside_tls(
    tmp_path: Path,
) -> None:
    async with tls_coordinator(
        tmp_path, health_address="127.0.0.1:0", reflection_enabled=True
    ) as server:
        assert server.health_listener is not None
        health = server.health_listener.bound_address
        assert port_of(health) != server.port
        with pytest.raises(aio.AioRpcError):  # its control port is TLS only
            await check(f"127.0.0.1:{server.port}", "")
        assert await health_list(health) == {"": SERVING, COORDINATOR_SERVICE: SERVING}
        async with aio.insecure_channel(health) as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            await unimplemented(
                stub.ListParticipants(
                    cpb.ListParticipantsRequest(), metadata=METADATA, timeout=WAIT
                )
            )
            assert_typed_invalid_request(await send_raw(channel, HEALTH + "Check", GARBAGE[1]))
            await unimplemented(reflected_services(channel))
        async with watching(health, "", COORDINATOR_SERVICE) as w:
            for watcher in w.values():
                await watcher.until(SERVING)
            stopping = asyncio.ensure_future(server.stop())
            for watcher in w.values():
                await watcher.until(NOT_SERVING)
                assert watcher.seen == [SERVING, NOT_SERVING]
            await stopping
        assert port_of(health) not in await listening_ports()


async def test_the_coordinator_binds_no_health_port_unless_configured(tmp_path: Path) -> None:
    before = await listening_ports()
    async with tls_coordinator(tmp_path) as server:
        assert server.health_listener is None
        assert await listening_ports() - before == {server.port}


# -- the CLI --------------------------------------------------------------------------------


def coordinator_command(tmp_path: Path) -> list[str]:
    """`coordinator` of a one-member fleet; discovery is lazy, so it serves (and answers
    health) before the member, which never comes, does."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[participants]]\nname = "counter"\naddress = "127.0.0.1:9"\n')
    return [*CLI, "coordinator", "--fleet", str(fleet)]


async def test_serve_announces_the_health_port_set_from_the_environment(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    env = dict(
        ENV,
        ROLLOUT_CHECKPOINT_START_CLOSED="true",
        ROLLOUT_CHECKPOINT_TLS_CERT_FILE=str(cert),
        ROLLOUT_CHECKPOINT_TLS_KEY_FILE=str(key),
        ROLLOUT_CHECKPOINT_HEALTH_ADDRESS="127.0.0.1:0",
    )
    command = [*CLI, "serve", "counter", "--log-level", "info"]
    process, announced = started(command, env=env, log=tmp_path / "serve.log")
    with killed_at_exit(process):
        health = announced["health"]
        assert port_of(health) != port_of(announced["grpc"])
        credentials = grpc.ssl_channel_credentials(cert.read_bytes())
        address = f"localhost:{port_of(announced['grpc'])}"
        async with (
            ParticipantClient(address, TOKEN, credentials=credentials) as client,
            watching(health, *PARTICIPANT_NAMES) as w,
        ):
            await w[READINESS].until(NOT_SERVING)
            await client.resume("boot-1", time.time() + WAIT)
            await w[READINESS].until(SERVING)
            process.send_signal(signal.SIGTERM)
            for name in PARTICIPANT_NAMES:
                await w[name].until(NOT_SERVING)
        assert await asyncio.to_thread(process.wait, WAIT) in (0, -signal.SIGTERM)


async def test_serve_with_workers_announces_the_health_port(tmp_path: Path) -> None:
    command = [*CLI, "serve", "counter", "--workers", "2", "--health-address", "127.0.0.1:0"]
    process, announced = started(command, env=ENV, log=tmp_path / "serve.log")
    with killed_at_exit(process):
        assert announced["workers"] == 2
        assert await check(announced["health"], LIVENESS) == SERVING
        assert await check(announced["grpc"], LIVENESS) == SERVING
    # A worker has no sidecar: the flag is the main process's alone.
    worker = worker_command(["counter", "--health-address", "127.0.0.1:9001", "--workers", "2"])
    assert worker[4:] == ["counter"]


async def test_the_coordinator_cli_announces_the_health_port_only_when_asked(
    tmp_path: Path,
) -> None:
    command = [*coordinator_command(tmp_path), "--grpc-address", "127.0.0.1:0"]
    plain, announced = started(command, env=ENV, log=tmp_path / "plain.log")
    with killed_at_exit(plain):
        assert "health" not in announced
    with_health, announced = started(
        [*command, "--health-address", "127.0.0.1:0"], env=ENV, log=tmp_path / "health.log"
    )
    with killed_at_exit(with_health):
        assert await check(announced["health"], COORDINATOR_SERVICE) == SERVING
        assert port_of(announced["health"]) != port_of(announced["grpc"])


def test_a_taken_health_port_fails_the_start_and_is_named(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        for command in (
            [*coordinator_command(tmp_path), "--health-address", address],
            [*CLI, "serve", "counter", "--health-address", address],
        ):
            proc = subprocess.run(
                command, env=ENV, capture_output=True, text=True, timeout=120, check=False
            )
            assert proc.returncode == 8, (command, proc.stderr)
            assert address in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
