"""Health semantics end to end (control-plane.md §5), observed through grpc.health.v1 Watch.

* Liveness never moves through prepare, commit, restore and resume.
* Readiness: a pause shorter than the threshold stays SERVING, a longer one turns it
  NOT_SERVING (injected clock); `start_closed` and RESTORED are NOT_SERVING until Resume, with
  no flicker in between.
* The counter example run by `rollout-checkpoint serve` (settings from the environment, as
  in Kubernetes): the same transitions on a real clock, `/metrics` answering while admission
  is closed, SIGTERM turning every name NOT_SERVING before the server stops, and JSON log
  lines with checkpoint ids and without the token.
* The coordinator's own health turns NOT_SERVING on SIGTERM before it stops.

What tests/test_processes.py covers for the test double (start_closed, restore into a
fresh process, SIGTERM during an HTTP request) is not repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, start_harness, stop_harness
from .processes import started

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READINESS = "participant-readiness"
LIVENESS = "participant-liveness"
PARTICIPANT_SERVICE = "rollout_checkpoint.v1.ParticipantService"
COORDINATOR_SERVICE = "rollout_checkpoint.v1.CoordinatorService"
WAIT = 30.0


class Watcher:
    """Every status a Watch stream of one health name delivers, in order."""

    def __init__(self, channel: aio.Channel, service: str) -> None:
        self.service = service
        self.seen: list[int] = []
        self._changed = asyncio.Event()
        stub = health_pb2_grpc.HealthStub(channel)
        self._call = stub.Watch(health_pb2.HealthCheckRequest(service=service))
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(aio.AioRpcError, asyncio.CancelledError):
            async for reply in self._call:
                self.seen.append(int(reply.status))
                self._changed.set()

    async def until(self, status: int) -> None:
        async with asyncio.timeout(WAIT):
            while not self.seen or self.seen[-1] != status:
                self._changed.clear()
                await self._changed.wait()

    async def close(self) -> None:
        self._call.cancel()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def watching(address: str, *services: str) -> AsyncIterator[dict[str, Watcher]]:
    async with aio.insecure_channel(address) as channel:
        watchers = {name: Watcher(channel, name) for name in services}
        try:
            yield watchers
        finally:
            for watcher in watchers.values():
                await watcher.close()


async def check(address: str, service: str) -> int:
    async with aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT)
        return int(reply.status)


# -- in process, on the injected clock ------------------------------------------------------


async def test_liveness_never_moves_and_readiness_follows_the_pause_threshold(
    checkpoint_dir: str,
) -> None:
    h = await start_harness(readiness_pause_threshold_seconds=30)
    try:
        async with watching(h.grpc_address, LIVENESS, READINESS) as w:
            await w[READINESS].until(SERVING)
            assert (await h.http.post("/ng-rollout/r1/seed", json={"state": {"n": 1}})).is_success
            final = await h.client.prepare_until_final("c1", h.deadline())
            assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
            assert not (await h.client.get_status()).admission_open
            # Closed, but for less than the threshold: still in the Service.
            h.clock.advance(29)
            await h.client.commit("c1", h.deadline(), checkpoint_dir)
            assert await check(h.grpc_address, READINESS) == SERVING
            # Past the threshold without any event: the health follower flips it.
            h.clock.advance(2)
            await w[READINESS].until(NOT_SERVING)
            assert await check(h.grpc_address, LIVENESS) == SERVING
            await h.client.resume("c1", h.deadline())
            await w[READINESS].until(SERVING)
            # A short pause again (prepare, resume) never drops readiness.
            await h.client.prepare_until_final("c2", h.deadline())
            h.clock.advance(10)
            await h.client.resume("c2", h.deadline())
            assert await check(h.grpc_address, READINESS) == SERVING
            assert w[READINESS].seen == [SERVING, NOT_SERVING, SERVING]
            assert w[LIVENESS].seen == [SERVING]
    finally:
        await stop_harness(h)

    # A replacement: start_closed, restore, resume. Readiness goes up once, at the resume.
    fresh = await start_harness(start_closed=True)
    try:
        async with watching(fresh.grpc_address, LIVENESS, READINESS) as w:
            await w[READINESS].until(NOT_SERVING)
            restored = await fresh.client.restore(
                "restore-1", fresh.deadline(), checkpoint_dir, [EpisodeId("r1")]
            )
            assert restored.state == types_pb2.PARTICIPANT_STATE_RESTORED
            assert await check(fresh.grpc_address, READINESS) == NOT_SERVING
            fresh.clock.advance(60)  # RESTORED is not a pause: no threshold applies
            assert await check(fresh.grpc_address, READINESS) == NOT_SERVING
            await fresh.client.resume("restore-1", fresh.deadline())
            await w[READINESS].until(SERVING)
            assert w[READINESS].seen == [NOT_SERVING, SERVING]
            assert w[LIVENESS].seen == [SERVING]
    finally:
        await stop_harness(fresh)


# -- real processes -------------------------------------------------------------------------


def start(command: list[str], env: dict[str, str], stderr: Path) -> tuple[Any, dict[str, Any]]:
    return started(command, env=env, log=stderr)


@contextlib.contextmanager
def killed_at_exit(process: subprocess.Popen[str]) -> Iterator[None]:
    try:
        yield
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=WAIT)


CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
BASE_ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")


async def test_the_counter_served_by_the_cli_on_a_real_clock_and_sigterm(tmp_path: Path) -> None:
    env = dict(
        BASE_ENV,
        ROLLOUT_CHECKPOINT_START_CLOSED="true",
        ROLLOUT_CHECKPOINT_READINESS_PAUSE_THRESHOLD_SECONDS="0.3",
        ROLLOUT_CHECKPOINT_METRICS_PATH="/metrics",
        ROLLOUT_CHECKPOINT_ALLOWED_CHECKPOINT_ROOTS=json.dumps([str(tmp_path)]),
    )
    stderr = tmp_path / "stderr.jsonl"
    command = [*CLI, "serve", "counter", "--log-format", "json", "--log-level", "info"]
    process, announced = start(command, env, stderr)
    names = (READINESS, LIVENESS, "", PARTICIPANT_SERVICE)
    with killed_at_exit(process):
        async with (
            ParticipantClient(announced["grpc"], TOKEN) as client,
            httpx.AsyncClient(base_url=f"http://{announced['http']}", timeout=WAIT) as http,
            watching(announced["grpc"], *names) as w,
        ):
            # start_closed came from the environment: nothing is served before a resume.
            await w[READINESS].until(NOT_SERVING)
            await client.resume("boot-1", time.time() + 30)
            await w[READINESS].until(SERVING)
            seeded = await http.post("/ng-rollout/r1/seed_session", json={"initial_count": 2})
            assert seeded.status_code == 200, seeded.text

            final = await client.prepare_until_final("p1", time.time() + 30)
            assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
            metrics = await http.get("/metrics")  # admission is closed: a GET passes
            assert metrics.status_code == 200, metrics.text
            assert 'rollout_checkpoint_state{state="PREPARED"} 1.0' in metrics.text
            await w[READINESS].until(NOT_SERVING)  # closed longer than 0.3 s
            committed = await client.commit("p1", time.time() + 30, str(tmp_path / "ckpt"))
            assert list(committed.exported) == ["r1"]
            await client.resume("p1", time.time() + 30)
            await w[READINESS].until(SERVING)
            for name in names[1:]:
                assert w[name].seen == [SERVING], name

            process.send_signal(signal.SIGTERM)
            for name in names:
                await w[name].until(NOT_SERVING)
            assert w[LIVENESS].seen == [SERVING, NOT_SERVING]
            assert w[READINESS].seen == [NOT_SERVING, SERVING, NOT_SERVING, SERVING, NOT_SERVING]
        returncode = await asyncio.to_thread(process.wait, WAIT)
    assert returncode in (0, -signal.SIGTERM), returncode

    text = stderr.read_text()
    assert TOKEN not in text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    operations = {
        (line["message"].split(" ")[0], line["checkpoint_id"])
        for line in lines
        if line["logger"] == "rollout_checkpoint.server.runtime.telemetry"
    }
    assert {("resume", "boot-1"), ("prepare", "p1"), ("commit", "p1"), ("resume", "p1")} <= (
        operations
    )
    assert any(line["logger"].startswith("uvicorn") for line in lines)


async def test_the_coordinator_turns_not_serving_on_sigterm_before_it_stops(
    tmp_path: Path,
) -> None:
    fleet = tmp_path / "fleet.toml"
    # Discovery is lazy: the coordinator serves (and answers health) before any member does.
    fleet.write_text('[[participants]]\nname = "counter"\naddress = "127.0.0.1:9"\n')
    command = [*CLI, "coordinator", "--fleet", str(fleet), "--grpc-address", "127.0.0.1:0"]
    process, announced = start(command, BASE_ENV, tmp_path / "stderr.log")
    with killed_at_exit(process):
        async with watching(announced["grpc"], "", COORDINATOR_SERVICE) as w:
            for watcher in w.values():
                await watcher.until(SERVING)
            process.send_signal(signal.SIGTERM)
            for watcher in w.values():
                await watcher.until(NOT_SERVING)
                assert watcher.seen == [SERVING, NOT_SERVING]
        assert await asyncio.to_thread(process.wait, WAIT) == 0
