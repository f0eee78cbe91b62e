"""Real processes: `python -m tests.double` with its own HTTP and gRPC ports.

Start closed, checkpoint, SIGKILL, restore into a fresh `--start-closed` process, continue;
refusal of a restore into a process that served; SIGTERM turns health NOT_SERVING at once.
Readiness flips are observed through grpc.health.v1 Watch streams (pushed by the server),
each read bounded by a timeout, never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, DoubleProcess, kill_group, refused

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READINESS = "participant-readiness"
LIVENESS = "participant-liveness"
SERVICE = "rollout_checkpoint.v1.ParticipantService"
WAIT = 30.0  # bound on any single observation of a real process

STATE = {"zeta": [1, 2, {"y": 2**80, "b": "two"}], "alpha": {"k2": True, "k1": None}, "n": 1}


@contextlib.asynccontextmanager
async def opened(
    double: DoubleProcess,
) -> AsyncIterator[tuple[ParticipantClient, httpx.AsyncClient, Any]]:
    """A control client (with the token), an HTTP client and a health stub (no token)."""
    client = ParticipantClient(double.grpc_address, TOKEN)
    channel = aio.insecure_channel(double.grpc_address)
    async with httpx.AsyncClient(base_url=double.base_url, timeout=WAIT) as http:
        try:
            yield client, http, health_pb2_grpc.HealthStub(channel)
        finally:
            await client.close()
            await channel.close()


async def check(health: Any, service: str) -> int:
    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT)
    return int(reply.status)


async def next_status(watch: Any) -> int:
    message = await asyncio.wait_for(watch.read(), WAIT)
    assert message is not aio.EOF, "the Watch stream ended"
    return int(message.status)


async def seed(http: httpx.AsyncClient, key: str, state: Any) -> httpx.Response:
    return await http.post(f"/ng-rollout/{key}/seed", json={"state": state})


def assert_awaiting_restore(response: httpx.Response) -> None:
    """A start_closed process before its Resume: its own refusal, not `admission_closed`."""
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "awaiting_restore"


def deadline(seconds: float = 30.0) -> float:
    return time.time() + seconds


# -- start_closed ---------------------------------------------------------------------------


async def test_start_closed_serves_nothing_until_resume(spawn: Any) -> None:
    double = spawn("--start-closed")
    async with opened(double) as (client, http, health):
        assert_awaiting_restore(await seed(http, "r1", {"n": 1}))
        assert (await http.get("/ng-rollout/r1/state")).status_code == 404
        # Health needs no token; only readiness is down.
        assert await check(health, READINESS) == NOT_SERVING
        assert await check(health, LIVENESS) == SERVING
        assert await check(health, "") == SERVING
        assert await check(health, SERVICE) == SERVING
        status = await client.get_status()
        assert status.state == types_pb2.PARTICIPANT_STATE_IDLE
        assert not status.admission_open

        watch = health.Watch(health_pb2.HealthCheckRequest(service=READINESS))
        try:
            assert await next_status(watch) == NOT_SERVING
            resumed = await client.resume("boot-1", deadline())
            assert not resumed.idempotent  # it opened the start_closed process
            assert await next_status(watch) == SERVING
        finally:
            watch.cancel()

        assert await check(health, READINESS) == SERVING
        response = await seed(http, "r1", {"n": 1})
        assert response.status_code == 200, response.text
        assert (await http.get("/ng-rollout/r1/state")).json() == {"state": {"n": 1}}
        assert (await client.get_status()).admission_open


async def test_checkpoint_sigkill_restore_into_a_start_closed_process_and_continue(
    spawn: Any, tmp_path: Path
) -> None:
    checkpoint_dir = str(tmp_path / "ckpt")
    first = spawn()
    async with opened(first) as (client, http, _health):
        response = await seed(http, "r1", STATE)
        assert response.status_code == 200, response.text
        final = await client.prepare_until_final("ckpt-1", deadline())
        assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
        committed = await client.commit("ckpt-1", deadline(), checkpoint_dir)
        assert list(committed.exported) == ["r1"]
        assert committed.manifest.record_count == 1
        part = Path(checkpoint_dir, "participants", "resources", "double")
        assert sorted(os.listdir(part)) == ["manifest.json", committed.manifest.records_file]
        await client.resume("ckpt-1", deadline())
    kill_group(first.process)
    assert first.process.returncode == -signal.SIGKILL

    fresh = spawn("--start-closed")
    async with opened(fresh) as (client, http, health):
        watch = health.Watch(health_pb2.HealthCheckRequest(service=READINESS))
        try:
            assert await next_status(watch) == NOT_SERVING
            restored = await client.restore(
                "restore-1", deadline(), checkpoint_dir, scope=[EpisodeId("r1", 0)]
            )
            assert restored.state == types_pb2.PARTICIPANT_STATE_RESTORED
            assert restored.source_checkpoint_id == "ckpt-1"
            assert list(restored.restored) == ["r1-a1"]
            status = await client.get_status()
            assert status.state == types_pb2.PARTICIPANT_STATE_RESTORED
            assert status.checkpoint_id == "restore-1"
            assert status.restored_pending == 1

            # The restored state is there, byte for byte (key order and big integers too)...
            state = await http.get("/ng-rollout/r1-a1/state")
            assert state.status_code == 200, state.text
            assert (
                state.content
                == json.dumps({"state": STATE}, separators=(",", ":"), ensure_ascii=False).encode()
            )
            assert (await http.get("/ng-rollout/r1/state")).status_code == 404
            # ...but the data plane stays closed, and readiness down, until Resume.
            assert_awaiting_restore(await seed(http, "r2", {"n": 2}))
            assert await check(health, READINESS) == NOT_SERVING

            resumed = await client.resume("restore-1", deadline())
            assert not resumed.idempotent
            assert await next_status(watch) == SERVING
        finally:
            watch.cancel()

        response = await seed(http, "r2", {"n": 2})
        assert response.status_code == 200, response.text
        # The restored episode continues as attempt 1.
        update = await http.post("/ng-rollout/r1-a1/update", json={"state": {"n": 3}})
        assert update.status_code == 200, update.text
        assert (await http.get("/ng-rollout/r1-a1/state")).json() == {"state": {"n": 3}}
        status = await client.get_status()
        assert status.state == types_pb2.PARTICIPANT_STATE_IDLE
        assert status.admission_open


async def test_a_process_that_served_refuses_restore(spawn: Any, tmp_path: Path) -> None:
    double = spawn()
    async with opened(double) as (client, http, _health):
        response = await seed(http, "r1", {"n": 1})
        assert response.status_code == 200, response.text

        await refused(
            client.restore(
                "restore-1", deadline(), str(tmp_path / "ckpt"), scope=[EpisodeId("r1", 0)]
            ),
            "FRESH_PROCESS_REQUIRED",
            "FAILED_PRECONDITION",
        )

        status = await client.get_status()
        assert status.state == types_pb2.PARTICIPANT_STATE_IDLE
        assert status.admission_open
        assert (await seed(http, "r2", {"n": 2})).status_code == 200
        assert not (tmp_path / "ckpt").exists()


# -- SIGTERM --------------------------------------------------------------------------------


async def test_sigterm_turns_health_not_serving_at_once_and_exits(
    spawn: Any, tmp_path: Path
) -> None:
    stderr = tmp_path / "stderr.log"
    # The held request below stays pending until the test releases it (SIGUSR1), however
    # long the checks take: uvicorn's graceful timeout is far longer than this test.
    double = spawn("--log-level", "debug", "--graceful-seconds", "120", stderr=stderr)
    async with opened(double) as (client, http, health):
        # Exercise the authenticated paths, and a refused token, before shutting down.
        assert (await client.get_participant()).instance == "double"
        async with ParticipantClient(double.grpc_address, "not-the-token") as wrong:
            await refused(wrong.get_status(), "TOKEN_INVALID", "UNAUTHENTICATED")
        assert (await seed(http, "r1", {"n": 1})).status_code == 200

        # An HTTP request held in flight: uvicorn waits for it (up to its graceful timeout)
        # before the lifespan shutdown, so NOT_SERVING while it is still pending proves the
        # flip did not wait for HTTP to drain.
        held = asyncio.ensure_future(
            http.post("/ng-rollout/r1/update", json={"state": {"n": 2}, "hold": True})
        )
        give_up = time.monotonic() + WAIT  # the hold shows as one request in flight
        while (await client.get_status()).readiness.counts.get("inflight") != 1:
            assert time.monotonic() < give_up, "the held request never arrived"
            assert not held.done(), held

        watches = {
            name: health.Watch(health_pb2.HealthCheckRequest(service=name))
            for name in (READINESS, "", LIVENESS)
        }
        try:
            for watch in watches.values():
                assert await next_status(watch) == SERVING

            os.kill(double.process.pid, signal.SIGTERM)

            for name, watch in watches.items():
                assert await next_status(watch) == NOT_SERVING, name
            assert not held.done()
            # Released, the held request completes on its open connection, and uvicorn's
            # shutdown goes on.
            os.kill(double.process.pid, signal.SIGUSR1)
            reply = await asyncio.wait_for(held, WAIT)
            assert reply.status_code == 200, reply.text
        finally:
            for watch in watches.values():
                watch.cancel()
            held.cancel()
            with contextlib.suppress(BaseException):
                await held

    returncode = await asyncio.to_thread(double.process.wait, WAIT)
    # uvicorn re-raises SIGTERM once serve() returns (toolchain.md, gotcha 1): after a clean
    # shutdown the process ends by that signal; 0 if the signal is ever swallowed instead.
    assert returncode in (0, -signal.SIGTERM), returncode
    log = stderr.read_text()
    assert "checkpoint sidecar" in log  # the log really was captured at debug level
    assert TOKEN not in log
    # The lifespan shutdown (health, sidecar stop) ran and did not fail, without a traceback.
    assert "Application shutdown complete." in log, log
    assert "Application shutdown failed" not in log, log
    assert "Traceback" not in log, log
