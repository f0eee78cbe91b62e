"""MCP exposure through a real MCP client (the SDK's streamable-HTTP client) against a real
uvicorn server: tools, the signed session token, admission (waiting, counting, retire
draining) and a restore that keeps the harness's token working.

Synchronization is by events and the participant's own state (its change notifications),
never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.counter import CounterServer, IncrementArgs, NoArgs
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.resources import ResourcesServerConfig, tool
from rollout_checkpoint.server.resources.mcp import TOKEN_HEADER, McpExposure
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, drain, serve_app, until_changed
from .processes import announcement, kill_group
from .processes import start as start_process

PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED
COMMITTED = types_pb2.PARTICIPANT_STATE_COMMITTED
WAIT = 30.0  # bound on any single wait


class HoldingCounter(CounterServer):
    """The counter plus a tool that stays in flight until the test releases it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    @tool("Wait until released, then add one.")
    async def hold(self, session_id: str, args: NoArgs) -> dict[str, Any]:
        self.entered.set()
        await self.release.wait()
        self.counters[session_id] = self.counters.get(session_id, 0) + 1
        return {"held": True}


def config(*, checkpoint: bool = True, start_closed: bool = False) -> ResourcesServerConfig:
    settings = CheckpointSettings(enabled=True, token=TOKEN, start_closed=start_closed)
    return ResourcesServerConfig(
        instance="counter",
        checkpoint=settings if checkpoint else None,
        expose_tools_over_mcp=True,
    )


@dataclass
class Served:
    server: CounterServer
    base_url: str
    http: httpx.AsyncClient
    uvicorn: uvicorn.Server
    serving: asyncio.Future[None]
    client: ParticipantClient | None

    @property
    def control(self) -> ParticipantClient:
        assert self.client is not None
        return self.client

    @property
    def participant(self) -> Any:
        assert self.server.participant is not None
        return self.server.participant

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` holds, re-checked on every participant change."""
        runtime = self.server.runtime
        assert runtime is not None
        await until_changed(runtime.control, predicate, WAIT)

    async def seed(self, key: str = "r1", initial_count: int = 1) -> dict[str, str]:
        """Seed a session (cookie kept by `http`); return the MCP headers of the reply."""
        path = "/seed_session" if self.server.runtime is None else f"/ng-rollout/{key}/seed_session"
        reply = await self.http.post(path, json={"initial_count": initial_count})
        assert reply.status_code == 200, reply.text
        info = reply.json()["mcp"]
        assert info["url_path"] == "/mcp" and info["transport"] == "streamable-http"
        assert info["server_name"] == "counter" and set(info["headers"]) == {TOKEN_HEADER}
        headers: dict[str, str] = info["headers"]
        return headers

    async def http_count(self) -> int:
        """The seeded session's counter, read over HTTP with the cookie."""
        reply = await self.http.post("/get_counter_value", json={})
        assert reply.status_code == 200, reply.text
        count: int = reply.json()["count"]
        return count


async def serve(server: CounterServer) -> Served:
    started, serving, port = await serve_app(server.build_app())
    base_url = f"http://127.0.0.1:{port}"
    client = None
    if server.runtime is not None:
        client = ParticipantClient(f"127.0.0.1:{server.runtime.port}", TOKEN)
    return Served(
        server,
        base_url,
        httpx.AsyncClient(base_url=base_url, timeout=WAIT),
        started,
        serving,
        client,
    )


async def stop(served: Served) -> None:
    if isinstance(served.server, HoldingCounter):
        served.server.release.set()
    await served.http.aclose()
    if served.client is not None:
        await served.client.close()
    served.uvicorn.should_exit = True
    await served.serving


@contextlib.asynccontextmanager
async def running(server: CounterServer) -> AsyncIterator[Served]:
    served = await serve(server)
    try:
        yield served
    finally:
        await stop(served)


@contextlib.asynccontextmanager
async def mcp_client(
    served: Served, headers: dict[str, str], mode: str = "auto"
) -> AsyncIterator[Client]:
    """An MCP client session at `/mcp`, sending `headers` (the token) on every request."""
    async with (
        httpx2.AsyncClient(headers=headers, timeout=WAIT) as http,
        Client(
            streamable_http_client(f"{served.base_url}/mcp", http_client=http), mode=mode
        ) as client,
    ):
        await client.list_tools()  # as harnesses do; also primes the client's schema cache
        yield client


def deadline(seconds: float = 30.0) -> float:
    return time.time() + seconds


def watch_admission_waits(participant: Any) -> asyncio.Event:
    """An event set when a request starts waiting for admission while it is closed."""
    waiting = asyncio.Event()
    original = participant.wait_for_admission

    async def wait_for_admission() -> bool:
        if not participant.admission_open:
            waiting.set()
        result: bool = await original()
        return result

    participant.wait_for_admission = wait_for_admission
    return waiting


def records(checkpoint_dir: Path) -> list[dict[str, Any]]:
    part = checkpoint_dir / "participants" / "resources" / "counter"
    manifest = json.loads((part / "manifest.json").read_text())
    return [json.loads(line) for line in (part / manifest["records_file"]).read_text().splitlines()]


def text_of(result: Any) -> str:
    [content] = result.content
    text: str = content.text
    return text


# -- tools --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_tools_list_shows_exactly_the_servers_tools(mode: str) -> None:
    async with running(CounterServer(config())) as served:
        headers = await served.seed()
        async with mcp_client(served, headers, mode) as client:
            listed = await client.list_tools()
        # No seed/verify/close route, no checkpoint control route: only the tools.
        assert {t.name: t.input_schema for t in listed.tools} == {
            "get_counter_value": NoArgs.model_json_schema(),
            "increment_counter": IncrementArgs.model_json_schema(),
        }
        assert {t.name: t.description for t in listed.tools} == {
            "get_counter_value": "Read the session's counter.",
            "increment_counter": "Add `count` to the session's counter.",
        }
        # The endpoint is exactly /mcp: answered there, never redirected to /mcp/.
        raw = await served.http.post(
            "/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
            headers={"accept": "application/json, text/event-stream"},
        )
        assert raw.status_code == 200, raw.text
        assert raw.headers["content-type"].startswith("application/json")
        assert "mcp-session-id" not in raw.headers  # stateless: no SDK session to lose
        assert sorted(t["name"] for t in raw.json()["result"]["tools"]) == [
            "get_counter_value",
            "increment_counter",
        ]


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_tool_call_with_the_token_changes_that_sessions_counter(mode: str) -> None:
    async with running(CounterServer(config())) as served:
        headers = await served.seed(initial_count=1)
        async with mcp_client(served, headers, mode) as client:
            result = await client.call_tool("increment_counter", {"count": 4})
            assert not result.is_error
            assert text_of(result) == '{"success":true}'  # the HTTP route's body, byte for byte
            assert result.structured_content == {"success": True}
            read = await client.call_tool("get_counter_value", {})
            assert read.structured_content == {"count": 5}
            # Arguments are validated by the tool's model: a tool error, nothing runs.
            bad = await client.call_tool("increment_counter", {"count": "many"})
            assert bad.is_error and "invalid arguments" in text_of(bad)
        assert await served.http_count() == 5


# -- admission ----------------------------------------------------------------------------


async def test_a_call_during_a_checkpoint_waits_and_runs_after_resume(tmp_path: Path) -> None:
    async with running(CounterServer(config())) as served:
        headers = await served.seed(initial_count=1)
        async with mcp_client(served, headers) as client:
            final = (await drain(served.control.prepare("c1", deadline())))[-1]
            assert final.state == PREPARED
            waiting = watch_admission_waits(served.participant)
            call = asyncio.ensure_future(client.call_tool("increment_counter", {"count": 5}))
            await asyncio.wait_for(waiting.wait(), WAIT)
            # Waiting, not refused, not in flight: the checkpoint stays ready.
            assert not call.done()
            status = await served.control.get_status()
            assert status.state == PREPARED and status.readiness.ready
            assert status.readiness.counts["inflight"] == 0 and served.participant.inflight == 0

            committed = await served.control.commit("c1", deadline(), str(tmp_path))
            assert committed.state == COMMITTED and list(committed.exported) == ["r1"]
            [record] = records(tmp_path)
            assert record["state"] == {"count": 1}  # from before the waiting call
            assert not call.done()

            await served.control.resume("c1", deadline())
            result = await asyncio.wait_for(call, WAIT)
            assert not result.is_error and result.structured_content == {"success": True}
        assert await served.http_count() == 6


async def test_a_call_in_flight_holds_up_prepare() -> None:
    server = HoldingCounter(config())
    async with running(server) as served:
        headers = await served.seed()
        async with mcp_client(served, headers) as client:
            call = asyncio.ensure_future(client.call_tool("hold", {}))
            await asyncio.wait_for(server.entered.wait(), WAIT)
            stream = served.control.prepare("c1", deadline())
            first = await asyncio.wait_for(stream.__anext__(), WAIT)
            assert first.update_kind == pb.PREPARE_UPDATE_KIND_INITIAL
            assert not first.readiness.ready
            assert [(b.capture_key, b.reason) for b in first.readiness.blockers] == [
                ("r1", types_pb2.BLOCKER_REASON_REQUEST_IN_FLIGHT)
            ]
            assert first.readiness.counts["inflight"] == 1
            server.release.set()
            rest = await asyncio.wait_for(drain(stream), WAIT)
            assert rest[-1].final and rest[-1].state == PREPARED and rest[-1].readiness.ready
            result = await asyncio.wait_for(call, WAIT)
            assert result.structured_content == {"held": True}
            await served.control.resume("c1", deadline())
        assert await served.http_count() == 2


async def test_retire_drains_the_sessions_mcp_call_and_refuses_new_ones() -> None:
    server = HoldingCounter(config())
    async with running(server) as served:
        headers = await served.seed()
        assert served.server.mcp is not None
        session_id = served.server.mcp.session_from_token(headers[TOKEN_HEADER])
        assert session_id is not None and session_id in server.counters
        async with mcp_client(served, headers) as client:
            held = asyncio.ensure_future(client.call_tool("hold", {}))
            await asyncio.wait_for(server.entered.wait(), WAIT)
            retire = asyncio.ensure_future(
                served.control.retire("x", deadline(), [EpisodeId("r1")])
            )
            await served.until(lambda: session_id in served.participant.retired_sessions)

            # The retire waits for the call in flight; meanwhile the session is refused.
            assert not retire.done()
            with pytest.raises(MCPError):
                await client.call_tool("get_counter_value", {})
            raw = await served.http.post(
                "/mcp",
                json={"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {}},
                headers={TOKEN_HEADER: headers[TOKEN_HEADER]},
            )
            assert raw.status_code == 409 and raw.json()["error"]["code"] == "stale_attempt"
            assert not retire.done()

            server.release.set()
            assert (await asyncio.wait_for(held, WAIT)).structured_content == {"held": True}
            reply = await asyncio.wait_for(retire, WAIT)
            assert list(reply.retired) == ["r1"]
            assert session_id not in server.counters  # freed after the drain

            with pytest.raises(MCPError):
                await client.call_tool("increment_counter", {"count": 1})
            assert session_id not in server.counters


async def test_a_restored_server_accepts_the_old_token(tmp_path: Path) -> None:
    checkpoint_dir = str(tmp_path / "ckpt")
    async with running(CounterServer(config())) as first:
        headers = await first.seed(initial_count=1)
        async with mcp_client(first, headers) as client:
            await client.call_tool("increment_counter", {"count": 2})
        await drain(first.control.prepare("c1", deadline()))
        await first.control.commit("c1", deadline(), checkpoint_dir)

    # The replacement process: same control token and instance, so the same derived secrets.
    second_server = CounterServer(config(start_closed=True))
    assert second_server.session_secret == first.server.session_secret
    async with running(second_server) as second:
        waiting = watch_admission_waits(second.participant)

        async def harness_retries() -> Any:
            async with mcp_client(second, headers) as client:
                return await client.call_tool("get_counter_value", {})

        # The harness reconnects with its old token before the restore: it waits (it is
        # neither refused nor served, so the process can still be restored).
        retried = asyncio.ensure_future(harness_retries())
        await asyncio.wait_for(waiting.wait(), WAIT)
        restored = await second.control.restore(
            "restore-1", deadline(), checkpoint_dir, [EpisodeId("r1")]
        )
        assert list(restored.restored) == ["r1-a1"]
        assert not retried.done()
        await second.control.resume("restore-1", deadline())
        read = await asyncio.wait_for(retried, WAIT)
        assert not read.is_error and read.structured_content == {"count": 3}

        async with mcp_client(second, headers) as client:
            await client.call_tool("increment_counter", {"count": 10})
            assert (await client.call_tool("get_counter_value", {})).structured_content == {
                "count": 13
            }
        assert (await second.control.get_status()).restored_pending == 0  # claimed


async def test_a_tampered_token_is_rejected_and_changes_nothing() -> None:
    # The same instance name under another session secret: another key.
    elsewhere = McpExposure(
        CounterServer(ResourcesServerConfig(instance="counter", session_secret="x" * 32))
    )
    async with running(CounterServer(config())) as served:
        headers = await served.seed(initial_count=1)
        exposure = served.server.mcp
        assert exposure is not None
        token = headers[TOKEN_HEADER]
        session_id = exposure.session_from_token(token)
        assert session_id is not None
        payload, _, signature = token.rpartition(".")
        bad_tokens = [
            f"{payload}.{signature[:-2]}{'AA' if signature[-2:] != 'AA' else 'BB'}",
            f"{payload}x.{signature}",
            elsewhere.token_for(session_id),  # the right session id under another key
            "not-a-token",
        ]
        for bad in bad_tokens:
            assert exposure.session_from_token(bad) is None
            async with mcp_client(served, {TOKEN_HEADER: bad}) as client:
                result = await client.call_tool("increment_counter", {"count": 100})
                assert result.is_error and "invalid or missing session token" in text_of(result)
        async with mcp_client(served, {}) as client:  # no token at all
            result = await client.call_tool("increment_counter", {"count": 100})
            assert result.is_error and "invalid or missing session token" in text_of(result)
        assert await served.http_count() == 1
        assert served.participant.inflight == 0


async def test_mcp_works_with_checkpointing_off() -> None:
    async with running(CounterServer(config(checkpoint=False))) as served:
        assert served.server.runtime is None and served.server.participant is None
        reply = await served.http.post("/seed_session", json={"initial_count": 2})
        assert reply.status_code == 200
        assert "x-ng-checkpoint-verify" not in reply.headers
        headers = reply.json()["mcp"]["headers"]
        async with mcp_client(served, headers) as client:
            result = await client.call_tool("increment_counter", {"count": 3})
            assert result.structured_content == {"success": True}
        assert await served.http_count() == 5


async def test_the_serve_verb_with_mcp_serves_the_tools_in_its_own_process() -> None:
    process = start_process(
        [sys.executable, "-m", "rollout_checkpoint.examples.serve", "counter", "--mcp"],
        env=dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR"),
    )
    try:
        announced = await asyncio.to_thread(announcement, process, "the counter with MCP")
        base_url = f"http://{announced['http']}"
        async with httpx.AsyncClient(base_url=base_url, timeout=WAIT) as http:
            reply = await http.post("/ng-rollout/r1/seed_session", json={"initial_count": 7})
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-ng-checkpoint-verify"] == "wait"
            headers = reply.json()["mcp"]["headers"]
            async with (
                httpx2.AsyncClient(headers=headers, timeout=WAIT) as mcp_http,
                Client(streamable_http_client(f"{base_url}/mcp", http_client=mcp_http)) as client,
            ):
                assert (await client.call_tool("get_counter_value", {})).structured_content == {
                    "count": 7
                }
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 30) in (0, -signal.SIGTERM)
    finally:
        await asyncio.to_thread(kill_group, process)


async def test_a_close_during_an_mcp_call_leaves_readiness_clean() -> None:
    server = HoldingCounter(config())
    async with running(server) as served:
        headers = await served.seed()
        async with mcp_client(served, headers) as client:
            held = asyncio.ensure_future(client.call_tool("hold", {}))
            await asyncio.wait_for(server.entered.wait(), WAIT)
            closed = await served.http.post("/ng-rollout/r1/close_session", json={})
            assert closed.status_code == 200, closed.text
            server.release.set()
            await asyncio.wait_for(held, WAIT)
        assert served.participant.inflight == 0 and served.participant.ready()
        status = await served.control.get_status()
        assert list(status.readiness.blockers) == []
        assert status.readiness.ready
