"""The resources participant through real HTTP and real RPCs, on the counter example."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.counter import CounterServer, NoArgs
from rollout_checkpoint.examples.weather import WeatherServer
from rollout_checkpoint.server.core.clock import ManualClock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.resources import (
    CheckpointMode,
    ResourcesServer,
    ResourcesServerConfig,
    tool,
)
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, drain, refused, serve_app, until_changed
from .processes import announcement, kill_group
from .processes import start as start_process

SECRET = "a-fixed-session-secret-for-tests"


@dataclass
class Running:
    server: ResourcesServer
    clock: ManualClock
    base_url: str
    client: ParticipantClient
    uvicorn: uvicorn.Server
    serving: asyncio.Future[None]
    browsers: list[httpx.AsyncClient] = field(default_factory=list)

    def browser(self, cookies: httpx.Cookies | None = None) -> httpx.AsyncClient:
        """One episode's HTTP client: its own cookie jar, so its own session."""
        browser = httpx.AsyncClient(base_url=self.base_url, timeout=10, cookies=cookies)
        self.browsers.append(browser)
        return browser

    def deadline(self, seconds: float = 60) -> float:
        return self.clock.now() + seconds

    @property
    def participant(self) -> Any:
        return self.server.participant

    async def until(self, predicate: Any) -> None:
        assert self.server.runtime is not None
        await until_changed(self.server.runtime.control, predicate)

    async def stop(self) -> None:
        for browser in self.browsers:
            await browser.aclose()
        await self.client.close()
        self.uvicorn.should_exit = True
        await self.serving


async def start(
    cls: type[ResourcesServer] = CounterServer,
    *,
    checkpoint: bool = True,
    instance: str = "counter",
    **settings: Any,
) -> Running:
    clock = ManualClock()
    config = ResourcesServerConfig(
        instance=instance,
        checkpoint=CheckpointSettings(enabled=True, token=TOKEN, **settings)
        if checkpoint
        else None,
        session_secret=SECRET,
        clock=clock,
    )
    server = cls(config)
    app = server.build_app()
    runner, serving, port = await serve_app(app)
    address = server.runtime.address if server.runtime is not None else "127.0.0.1:1"
    return Running(
        server,
        clock,
        f"http://127.0.0.1:{port}",
        ParticipantClient(address, TOKEN, clock=clock.now),
        runner,
        serving,
    )


@contextlib.asynccontextmanager
async def running(
    cls: type[ResourcesServer] = CounterServer, **kwargs: Any
) -> AsyncIterator[Running]:
    r = await start(cls, **kwargs)
    try:
        yield r
    finally:
        await r.stop()


async def prepared(r: Running, checkpoint_id: str = "c1") -> Any:
    return (await drain(r.client.prepare(checkpoint_id, r.deadline())))[-1]


async def test_counter_checkpoint_restore_with_the_old_cookie(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    async with running() as a:
        episode = a.browser()
        seeded = await episode.post("/ng-rollout/r-a1/seed_session", json={"initial_count": 3})
        assert seeded.status_code == 200 and seeded.headers["x-ng-checkpoint-verify"] == "wait"
        for _ in range(2):
            assert (
                await episode.post("/ng-rollout/r-a1/increment_counter", json={"count": 2})
            ).json() == {"success": True}
        assert (await prepared(a)).state == types_pb2.PARTICIPANT_STATE_PREPARED
        commit = await a.client.commit("c1", a.deadline(), ckpt, [EpisodeId("r", 1)])
        assert list(commit.exported) == ["r-a1"]
        cookies = episode.cookies
    async with running() as b:
        restored = await b.client.restore("restore-1", b.deadline(), ckpt, [EpisodeId("r", 1)])
        assert list(restored.restored) == ["r-a2"]
        episode = b.browser(cookies)
        early = await episode.post("/ng-rollout/r-a2/increment_counter", json={"count": 1})
        assert early.status_code == 409 and early.json()["error"]["code"] == "admission_closed"
        await b.client.resume("restore-1", b.deadline())
        assert (
            await episode.post("/ng-rollout/r-a2/increment_counter", json={"count": 1})
        ).status_code == 200
        assert (await episode.post("/ng-rollout/r-a2/get_counter_value", json={})).json() == {
            "count": 8
        }
        verified = await episode.post("/ng-rollout/r-a2/verify", json={"expected_count": 8})
        assert verified.json()["reward"] == 1.0
        status = await b.client.get_status()
        assert status.readiness.counts["sessions"] == 0


async def test_a_request_in_flight_blocks_prepare_and_verify_ends_the_session() -> None:
    release = asyncio.Event()

    class SlowCounter(CounterServer):
        @tool("Wait for the test, then add one.")
        async def slow_increment(self, session_id: str, args: NoArgs) -> dict[str, Any]:
            await release.wait()
            self.counters[session_id] += 1
            return {"success": True}

    async with running(SlowCounter) as r:
        episode = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 0})
        call = asyncio.ensure_future(episode.post("/ng-rollout/r1/slow_increment", json={}))
        await r.until(lambda: r.participant.inflight == 1)
        stream = r.client.prepare("c1", r.deadline())
        first = await anext(stream)
        assert not first.readiness.ready and first.readiness.counts["inflight"] == 1
        assert [(b.capture_key, b.reason) for b in first.readiness.blockers] == [
            ("r1", types_pb2.BLOCKER_REASON_REQUEST_IN_FLIGHT)
        ]
        release.set()
        assert (await call).status_code == 200
        assert (await drain(stream))[-1].state == types_pb2.PARTICIPANT_STATE_PREPARED
        await r.client.resume("c1", r.deadline())
        assert (await r.client.get_status()).readiness.counts["sessions"] == 1
        assert (await episode.post("/ng-rollout/r1/verify", json={"expected_count": 1})).json()[
            "reward"
        ] == 1.0
        assert (await r.client.get_status()).readiness.counts["sessions"] == 0


class RestartOnlyCounter(CounterServer):
    checkpoint_mode = CheckpointMode.RESTART_ONLY


async def test_restart_only_sessions_block_until_retired() -> None:
    async with running(RestartOnlyCounter) as r:
        episode = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 5})
        stream = r.client.prepare("c1", r.deadline(5))
        first = await anext(stream)
        assert [(b.capture_key, b.reason) for b in first.readiness.blockers] == [
            ("r1", types_pb2.BLOCKER_REASON_RESTART_ONLY_SESSION)
        ]
        r.clock.advance(6)
        assert (await drain(stream))[-1].state == types_pb2.PARTICIPANT_STATE_PREPARING
        await r.client.resume("c1", r.deadline())
        await r.client.retire("x", r.deadline(), [EpisodeId("r1")])
        assert (await prepared(r, "c2")).state == types_pb2.PARTICIPANT_STATE_PREPARED
        await r.client.resume("c2", r.deadline())
        late = await episode.post("/ng-rollout/r1/increment_counter", json={"count": 1})
        assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt"
        assert (await episode.post("/ng-rollout/r1/close_session")).status_code == 200
        assert (await r.client.get_status()).counters["retired_sessions"] == 1
        await r.client.forget("x", r.deadline(), ["r1"])
        assert (await r.client.get_status()).counters["retired_sessions"] == 0
        fresh = r.browser()
        assert (await fresh.post("/ng-rollout/r1/seed_session", json={})).status_code == 200


async def test_close_during_a_checkpoint_waits_and_does_not_hold_prepare(tmp_path: Path) -> None:
    async with running() as r:
        episode = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 1})
        assert (await prepared(r)).state == types_pb2.PARTICIPANT_STATE_PREPARED
        close = asyncio.ensure_future(episode.post("/ng-rollout/r1/close_session"))
        await r.until(lambda: r.participant.waiting == 1)
        assert not close.done()
        assert r.participant.inflight == 0 and r.participant.ready()
        commit = await r.client.commit("c1", r.deadline(), str(tmp_path / "ckpt"))
        assert list(commit.exported) == ["r1"]
        await r.client.resume("c1", r.deadline())
        assert (await close).status_code == 200
        assert (await r.client.get_status()).readiness.counts["sessions"] == 0


async def test_a_seed_that_outlives_the_checkpoint_it_began_in_is_exported_by_the_next(
    tmp_path: Path,
) -> None:
    """A seed admitted while a checkpoint holds admission closed is not that checkpoint's (its
    episode's boundary precedes it). If it ends only after the reopen, the window it began in
    is over: the session is an ordinary live one, and the next checkpoint must export it. It
    used to stay marked "seeded while closed" until the *next* reopen, so the next checkpoint
    left a live, used session out: after a crash its state was lost."""
    entered, release = asyncio.Event(), asyncio.Event()

    class SlowSeed(CounterServer):
        async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
            entered.set()
            await release.wait()
            return await super().seed_session(session_id, body)

    async with running(SlowSeed) as r:
        assert (await prepared(r, "c1")).state == types_pb2.PARTICIPANT_STATE_PREPARED
        episode = r.browser()
        seed = asyncio.ensure_future(
            episode.post("/ng-rollout/r9-a1/seed_session", json={"initial_count": 5})
        )
        await entered.wait()  # admitted while closed (a seed is replay-safe)
        first = await r.client.commit("c1", r.deadline(), str(tmp_path / "c1"))
        assert list(first.exported) == []
        await r.client.resume("c1", r.deadline())
        release.set()
        assert (await seed).status_code == 200
        step = await episode.post("/ng-rollout/r9-a1/increment_counter", json={"count": 1})
        assert step.status_code == 200
        assert (await prepared(r, "c2")).state == types_pb2.PARTICIPANT_STATE_PREPARED
        second = await r.client.commit("c2", r.deadline(), str(tmp_path / "c2"))
        assert list(second.exported) == ["r9-a1"]


async def test_retire_waits_for_the_request_in_flight_and_refuses_new_ones() -> None:
    release = asyncio.Event()

    class SlowCounter(CounterServer):
        @tool("Wait for the test.")
        async def slow(self, session_id: str, args: NoArgs) -> dict[str, Any]:
            await release.wait()
            return {"done": True}

    async with running(SlowCounter) as r:
        episode = r.browser()
        other = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={})
        await other.post("/ng-rollout/r2/seed_session", json={"initial_count": 7})
        call = asyncio.ensure_future(episode.post("/ng-rollout/r1/slow", json={}))
        await r.until(lambda: r.participant.inflight == 1)
        retire = asyncio.ensure_future(r.client.retire("x", r.deadline(), [EpisodeId("r1")]))
        await r.until(
            lambda: "r1" in {e.rollout_id for e in r.participant.retired_sessions.values()}
        )
        meanwhile = await episode.post("/ng-rollout/r1/increment_counter", json={"count": 1})
        assert meanwhile.status_code == 409 and meanwhile.json()["error"]["code"] == "stale_attempt"
        assert not retire.done()
        release.set()
        assert (await call).status_code == 200
        await retire
        assert r.server.counters.keys() == {
            next(iter(r.participant.sessions))
        }  # only r2's state left
        assert (await other.post("/ng-rollout/r2/get_counter_value", json={})).json() == {
            "count": 7
        }
        late = await episode.post("/increment_counter", json={"count": 1})  # no prefix: by cookie
        assert late.status_code == 409
        assert len(r.server.counters) == 1


async def test_an_invalid_restored_state_installs_nothing(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    async with running() as a:
        for rollout in ("r1", "r2"):
            browser = a.browser()
            await browser.post(f"/ng-rollout/{rollout}/seed_session", json={"initial_count": 1})
        await prepared(a)
        await a.client.commit("c1", a.deadline(), ckpt)
    import hashlib
    import json

    part = Path(ckpt, "participants", "resources", "counter")
    manifest = json.loads((part / "manifest.json").read_text())
    lines = (part / manifest["records_file"]).read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"count":1', b'"count":"1"')
    data = b"".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    (part / manifest["records_file"]).unlink()
    (part / f"records-{digest}.jsonl").write_bytes(data)
    manifest.update(records_file=f"records-{digest}.jsonl", records_sha256=digest, bytes=len(data))
    (part / "manifest.json").write_text(json.dumps(manifest))
    async with running() as b:
        error = await refused(
            b.client.restore("restore-1", b.deadline(), ckpt, [EpisodeId("r1"), EpisodeId("r2")]),
            "INVALID_CHECKPOINT_STATE",
            "FAILED_PRECONDITION",
        )
        assert error.metadata["captureKey"] == "r2"
        status = await b.client.get_status()
        assert (
            status.state == types_pb2.PARTICIPANT_STATE_IDLE
            and status.readiness.counts["sessions"] == 0
        )
        assert b.server.counters == {}


async def test_a_dropped_session_is_left_out_and_the_commit_succeeds(tmp_path: Path) -> None:
    async with running() as r:
        episode = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 1})
        r.server.counters.clear()  # the server dropped it (e.g. a verification that failed)
        assert (await r.client.get_status()).readiness.counts["sessions"] == 1
        await prepared(r)
        commit = await r.client.commit("c1", r.deadline(), str(tmp_path / "ckpt"))
        assert commit.manifest.record_count == 0 and list(commit.exported) == []
        assert (await r.client.get_status()).readiness.counts["sessions"] == 0


async def test_commit_scope_releases_unused_restored_sessions(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    async with running() as a:
        for rollout in ("r1", "r2"):
            await a.browser().post(f"/ng-rollout/{rollout}/seed_session", json={"initial_count": 4})
        await prepared(a)
        await a.client.commit("c1", a.deadline(), ckpt)
    async with running() as b:
        await b.client.restore("restore-1", b.deadline(), ckpt, [EpisodeId("r1"), EpisodeId("r2")])
        assert len(b.server.counters) == 2
        await b.client.resume("restore-1", b.deadline())
        await prepared(b, "c2")
        commit = await b.client.commit(
            "c2", b.deadline(), str(tmp_path / "c2"), [EpisodeId("r1", 1)]
        )
        assert list(commit.exported) == ["r1-a1"] and list(commit.retired) == ["r2-a1"]
        assert len(b.server.counters) == 1
        await b.client.resume("c2", b.deadline())
        late = await b.browser().post("/ng-rollout/r2-a1/seed_session", json={})
        assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt"


async def test_a_start_closed_server_refuses_awaiting_restore_and_counts_it() -> None:
    async with running(start_closed=True, metrics_path="/metrics") as r:
        episode = r.browser()
        for path, body in (
            ("/ng-rollout/r1/seed_session", {"initial_count": 1}),  # even a replay-safe seed
            ("/ng-rollout/r1/increment_counter", {"count": 1}),
        ):
            early = await episode.post(path, json=body)
            assert early.status_code == 409
            assert early.json()["error"] == {
                "code": "awaiting_restore",
                "detail": "this process started closed and waits for its controller's "
                "Restore or Resume",
            }
        assert not r.participant.has_served()
        scraped = (await episode.get("/metrics")).text
        assert (
            'rollout_checkpoint_refusals_total{plane="data",reason="awaiting_restore"} 2.0'
            in scraped
        )
        assert not (await r.client.resume("boot-1", r.deadline())).idempotent
        seeded = await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 1})
        assert seeded.status_code == 200
        # A checkpoint later on is `admission_closed` again.
        await prepared(r, "c1")
        closed = await episode.post("/ng-rollout/r1/increment_counter", json={"count": 1})
        assert closed.json()["error"]["code"] == "admission_closed"
        await r.client.resume("c1", r.deadline())


async def test_seed_reply_header_says_the_verify_mode_and_nothing_when_off() -> None:
    async with running(WeatherServer, instance="weather") as r:
        reply = await r.browser().post("/ng-rollout/r1/seed_session", json={})
        assert reply.headers["x-ng-checkpoint-verify"] == "replay"
    async with running(checkpoint=False) as off:
        # Off means nothing installed: not even the rollout prefix (callers send none then).
        assert (await off.browser().post("/ng-rollout/r1/seed_session", json={})).status_code == 404
        reply = await off.browser().post("/seed_session", json={})
        assert reply.status_code == 200 and "x-ng-checkpoint-verify" not in reply.headers
        assert off.server.runtime is None and off.server.participant is None


def test_an_exported_server_without_hooks_fails_at_startup() -> None:
    class Incomplete(ResourcesServer):
        checkpoint_mode = CheckpointMode.EXPORTED

        async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
            return {}

    with pytest.raises(
        TypeError, match="does not implement restore_session_states, retire_session_state"
    ):
        Incomplete(ResourcesServerConfig(checkpoint=CheckpointSettings(enabled=True, token=TOKEN)))


async def test_shutdown_answers_waiting_requests_with_503() -> None:
    async with running() as r:
        episode = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={})
        await prepared(r)
        close = asyncio.ensure_future(episode.post("/ng-rollout/r1/close_session"))
        await r.until(lambda: r.participant.waiting == 1)
        assert r.server.runtime is not None
        await r.server.runtime.sidecar.begin_shutdown()
        reply = await close
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "shutting_down"
        error = await refused(r.client.renew("c1", r.deadline()), "SHUTTING_DOWN", "UNAVAILABLE")
        assert error.metadata == {}
        # Resume (the abort) still works, so a controller can always release the fleet.
        assert not (await r.client.resume("c1", r.deadline())).idempotent


def test_serve_runs_a_real_process_and_stops_on_sigterm(tmp_path: Path) -> None:
    import os
    import signal
    import sys

    process = start_process(
        [
            sys.executable,
            "-m",
            "rollout_checkpoint.examples.serve",
            "counter",
            "--instance",
            "counter-7",
        ],
        env=dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN),
    )
    try:
        announced = announcement(process, "the counter")
        assert announced["kind"] == "resources" and announced["instance"] == "counter-7"
        assert announced["pid"] == process.pid
        with httpx.Client(base_url=f"http://{announced['http']}") as http:
            assert (
                http.post("/ng-rollout/r1/seed_session", json={"initial_count": 2}).status_code
                == 200
            )
            assert http.post("/ng-rollout/r1/get_counter_value", json={}).json() == {"count": 2}

        async def describe() -> Any:
            async with ParticipantClient(announced["grpc"], TOKEN) as client:
                return await client.get_participant()

        info = asyncio.run(describe())
        assert info.instance == "counter-7" and dict(info.facts) == {
            "mode": "exported",
            "verify": "wait",
        }
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        kill_group(process)
