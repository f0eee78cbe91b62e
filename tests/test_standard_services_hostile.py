"""Garbage bytes to health and reflection: a typed refusal, one log line per interval.

Health takes no token (the kubelet sends none) and reflection may be on, so anyone who can
reach a sidecar's or the coordinator's port can send them anything. grpcio's generated
registrations answered bytes that do not parse with UNKNOWN and no details, and logged one
ERROR traceback per call. Now: INVALID_ARGUMENT with a `google.rpc.Status` whose ErrorInfo
says INVALID_REQUEST (as ParticipantService answers), at most one WARNING per interval,
and health keeps answering the kubelet's probe (Check) and watchers (Watch).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rollout_checkpoint.client.coordinator.service import SERVICE_NAME as COORDINATOR_SERVICE
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.server.core.rpc.standard_services import RateLimitedLog
from rollout_checkpoint.server.runtime.health import LIVENESS, READINESS
from rollout_checkpoint.server.runtime.servicer import SERVICE_NAME as PARTICIPANT_SERVICE

from .conftest import TOKEN, Harness, start_harness, stop_harness

HEALTH = "/grpc.health.v1.Health/"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
GARBAGE = [b"\xff\xff\xff", b"\x0a\x05ab", b"\x80"]
"""Corrupt wire format, a truncated field, a lone varint byte: no message parses them."""
BAD_SERVICE_NAME = b"\x0a\x02\xc3\x28"
"""A HealthCheckRequest whose `service` is not UTF-8."""


@dataclass
class Servers:
    harness: Harness
    coordinator: Coordinator

    @property
    def addresses(self) -> dict[str, str]:
        return {
            "sidecar": self.harness.grpc_address,
            "coordinator": f"127.0.0.1:{self.coordinator.port}",
        }


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[Servers]:
    harness = await start_harness(reflection=True)
    spec = FleetSpec(members=(MemberSpec("double", harness.grpc_address),), token=TOKEN)
    coordinator = Coordinator(spec, "127.0.0.1:0", reflection_enabled=True)
    await coordinator.start()
    try:
        yield Servers(harness, coordinator)
    finally:
        await coordinator.stop()
        await stop_harness(harness)


async def send_raw(channel: aio.Channel, method: str, raw: bytes) -> aio.AioRpcError:
    """One call with raw request bytes (identity serializers); it must fail."""
    try:
        if method == REFLECTION:
            stream = channel.stream_stream(method, request_serializer=None)
            async for _ in stream(iter([raw]), timeout=10):
                pass
        elif method == HEALTH + "Watch":
            watch = channel.unary_stream(method, request_serializer=None)
            async for _ in watch(raw, timeout=10):
                pass
        else:
            await channel.unary_unary(method, request_serializer=None)(raw, timeout=10)
    except aio.AioRpcError as error:
        return error
    raise AssertionError(f"{method} accepted {raw!r}")


def assert_typed_invalid_request(error: aio.AioRpcError) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    decoded = ControlError.from_rpc_error(error)
    assert decoded.reason == "INVALID_REQUEST", decoded
    assert decoded.domain == "rollout-checkpoint.dev"
    assert decoded.metadata == {"field": "request"}


METHODS = [HEALTH + "Check", HEALTH + "Watch", HEALTH + "List", REFLECTION]


@pytest.mark.parametrize("method", METHODS)
async def test_garbage_is_a_typed_invalid_request(servers: Servers, method: str) -> None:
    for address in servers.addresses.values():
        async with aio.insecure_channel(address) as channel:
            for raw in GARBAGE:
                assert_typed_invalid_request(await send_raw(channel, method, raw))
            if method in (HEALTH + "Check", HEALTH + "Watch"):
                assert_typed_invalid_request(await send_raw(channel, method, BAD_SERVICE_NAME))


async def test_a_flood_of_garbage_logs_one_line_and_no_traceback(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for address in servers.addresses.values():
        async with aio.insecure_channel(address) as channel:
            for _ in range(10):
                for method in METHODS:
                    assert_typed_invalid_request(await send_raw(channel, method, GARBAGE[0]))
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]
    hostile = [r for r in caplog.records if "do not parse" in r.getMessage()]
    # One line per server (each has its own limiter), whatever the number of calls.
    assert [r.levelno for r in hostile] == [logging.WARNING, logging.WARNING], [
        r.getMessage() for r in hostile
    ]
    await assert_still_serving(servers)


async def assert_still_serving(servers: Servers) -> None:
    """The kubelet's probe (Check), watchers (Watch), List and reflection all answer."""
    expected = {
        "sidecar": {"", PARTICIPANT_SERVICE, LIVENESS, READINESS},
        "coordinator": {"", COORDINATOR_SERVICE},
    }
    for name, address in servers.addresses.items():
        async with aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in expected[name]:
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (name, service)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            listed = await health.List(health_pb2.HealthListRequest(), timeout=5)
            assert set(listed.statuses) == expected[name]
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            services = [
                s.name async for reply in replies for s in reply.list_services_response.service
            ]
            assert "grpc.health.v1.Health" in services


async def test_health_and_reflection_serve_well_formed_requests(servers: Servers) -> None:
    await assert_still_serving(servers)
    async with aio.insecure_channel(servers.harness.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # the health protocol's answer


async def test_list_reports_not_serving_after_shutdown_begins() -> None:
    harness = await start_harness()
    try:
        await harness.runtime.sidecar.begin_shutdown()
        async with aio.insecure_channel(harness.grpc_address) as channel:
            listed = await health_pb2_grpc.HealthStub(channel).List(
                health_pb2.HealthListRequest(), timeout=5
            )
        assert set(listed.statuses) == {"", PARTICIPANT_SERVICE, LIVENESS, READINESS}
        assert {s.status for s in listed.statuses.values()} == {
            health_pb2.HealthCheckResponse.NOT_SERVING
        }
    finally:
        await stop_harness(harness)


def test_the_rate_limited_log_writes_one_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    log = RateLimitedLog(logging.getLogger("tests.hostile"), interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="tests.hostile"):
        for _ in range(50):
            log.warning("garbage from %s", "peer")
        now[0] += 59.9
        log.warning("garbage from %s", "peer")
        assert [r.getMessage() for r in caplog.records] == ["garbage from peer"]
        now[0] += 0.2
        log.warning("garbage from %s", "peer")
        now[0] += 60.0
        log.warning("garbage from %s", "peer")
    assert [r.getMessage() for r in caplog.records] == [
        "garbage from peer",
        "garbage from peer (50 more since the last such line, not logged)",
        "garbage from peer",
    ]
    assert {r.levelno for r in caplog.records} == {logging.WARNING}


async def test_a_flood_of_calls_without_the_token_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Same class: calls without the token are refused per call (and counted), but logged
    at most once per interval, whoever sends them and however fast."""
    caplog.set_level(logging.DEBUG)
    harness = await start_harness()
    try:
        async with aio.insecure_channel(harness.grpc_address) as channel:
            for _ in range(20):
                error = await send_raw(channel, f"/{PARTICIPANT_SERVICE}/GetStatus", b"")
                assert ControlError.from_rpc_error(error).reason == "TOKEN_INVALID"
    finally:
        await stop_harness(harness)
    refused = [r for r in caplog.records if "bearer token" in r.getMessage()]
    assert [r.levelno for r in refused] == [logging.WARNING], [r.getMessage() for r in refused]
    assert TOKEN not in caplog.text
