"""Requests that end early are normal: at most one INFO line, never a traceback, never a 500.

A client that disconnects mid-body (a collector stopped by SIGTERM) and a Retire of an
in-flight rollout used to make uvicorn log "Exception in ASGI application" with a traceback
(`ClientDisconnect`, `CancelledError`) in the agent's and environment's logs. Real uvicorn
servers here; the runtime's RequestEndingsMiddleware must end those requests cleanly, and
must still let a cancellation it did not cause (a shutdown) propagate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.agent import AgentConfig, AgentServer
from rollout_checkpoint.examples.environment import EnvironmentConfig, EnvironmentServer
from rollout_checkpoint.examples.policy_model import PolicyModelConfig, PolicyModelServer
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.request_endings import (
    RequestEndingsMiddleware,
    cancel_request,
)
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import TOKEN, serve_app

SETTINGS = CheckpointSettings(enabled=True, token=TOKEN)
ENDINGS_LOGGER = "rollout_checkpoint.server.runtime.request_endings"
WAIT = 10.0
TASK = {"task_id": "t1", "user_prompt": "hello", "environment": {}}


class LogWatch(logging.Handler):
    """Every record of the root logger and of uvicorn's (which does not propagate to the
    root), with an event per arrival so a test can wait for a request's ending line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.arrived = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.arrived.set()

    async def wait_for(self, predicate: Callable[[logging.LogRecord], bool]) -> None:
        async with asyncio.timeout(WAIT):
            while not any(predicate(r) for r in self.records):
                self.arrived.clear()
                await self.arrived.wait()

    def noisy(self) -> list[str]:
        """Records an operator would read as a failure: ERROR and above, or a traceback."""
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR or r.exc_info]

    def endings(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.name == ENDINGS_LOGGER]


@contextlib.contextmanager
def watched_logs() -> Iterator[LogWatch]:
    watch = LogWatch()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    endings = logging.getLogger(ENDINGS_LOGGER)
    level = endings.level
    endings.setLevel(logging.INFO)
    for logger in loggers:
        logger.addHandler(watch)
    try:
        yield watch
    finally:
        for logger in loggers:
            logger.removeHandler(watch)
        endings.setLevel(level)


def ended(record: logging.LogRecord) -> bool:
    """The line that says a request ended: ours after the fix, uvicorn's traceback before."""
    return record.name in (ENDINGS_LOGGER, "uvicorn.error") and record.levelno >= logging.INFO


class Held:
    """A stub upstream whose routes never answer until released: a request in flight."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    def app(self, *paths: str) -> Starlette:
        async def hold(request: Request) -> JSONResponse:
            self.reached.set()
            await self.release.wait()
            return JSONResponse({})

        return Starlette(routes=[Route(p, hold, methods=["POST", "GET"]) for p in paths])


@contextlib.asynccontextmanager
async def running(app: Any) -> AsyncIterator[str]:
    server, serving, port = await serve_app(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


# -- a client that leaves mid-body ----------------------------------------------------------


async def send_half_a_body(base_url: str, path: str) -> None:
    """Headers announcing 1000 bytes, 12 of them, then close the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        "content-length: 1000\r\n\r\n"
    )
    writer.write(head.encode() + b'{"task": {"t')
    await writer.drain()
    writer.close()
    await writer.wait_closed()


def agent_app(resources_url: str = "http://127.0.0.1:1") -> tuple[AgentServer, Any]:
    server = AgentServer(
        AgentConfig(
            model_url="http://127.0.0.1:1",
            servers={"prompt_injection": resources_url},
            checkpoint=SETTINGS,
        )
    )
    return server, server.build_app()


def environment_app(agent_url: str = "http://127.0.0.1:1") -> tuple[EnvironmentServer, Any]:
    server = EnvironmentServer(EnvironmentConfig(agent_url=agent_url, checkpoint=SETTINGS))
    return server, server.build_app()


def model_app() -> tuple[PolicyModelServer, Any]:
    server = PolicyModelServer(PolicyModelConfig(checkpoint=SETTINGS, latency=0.0))
    return server, server.build_app()


SERVERS = pytest.mark.parametrize(
    ("build", "path"),
    [
        (agent_app, "/ng-rollout/r1/run"),
        (environment_app, "/ng-rollout/r1/run"),
        (model_app, "/ng-rollout/r1/v1/chat/completions"),
    ],
    ids=["agent", "environment", "policy_model"],
)


@SERVERS
async def test_a_client_that_leaves_mid_body_is_one_info_line(
    build: Callable[[], tuple[Any, Any]], path: str
) -> None:
    server, app = build()
    async with running(app) as url:
        with watched_logs() as logs:
            await send_half_a_body(url, path)
            await logs.wait_for(ended)
            if isinstance(server, PolicyModelServer):  # a partial body never ran a generation
                assert server.participant is not None
                assert not server.participant.calls and not server.participant.ledgers
    assert logs.noisy() == []
    (line,) = logs.endings()
    assert line.levelno == logging.INFO and path.split("/")[-1] in line.getMessage()


@SERVERS
async def test_a_body_that_is_not_a_json_object_is_a_400(
    build: Callable[[], tuple[Any, Any]], path: str
) -> None:
    """Nearby: a whole body the handler cannot use is the caller's mistake, not a 500 with
    a logged traceback (nested deeper than the JSON parser goes, too)."""
    _, app = build()
    async with running(app) as url, httpx.AsyncClient(timeout=WAIT) as http:
        with watched_logs() as logs:
            for body in (b"not json", b"[1]", b"[" * 100_000 + b"]" * 100_000):
                reply = await http.post(url + path, content=body)
                assert reply.status_code == 400, reply.text
    assert logs.noisy() == []


# -- a retire of an in-flight rollout -------------------------------------------------------


async def retire_in_flight(server: Any, url: str, held: Held) -> httpx.Response:
    """Start rollout r1, wait until it is in flight upstream, retire it; its reply."""
    async with httpx.AsyncClient(timeout=WAIT) as http:
        run = asyncio.ensure_future(http.post(f"{url}/ng-rollout/r1/run", json={"task": TASK}))
        async with asyncio.timeout(WAIT):
            await held.reached.wait()
        async with ParticipantClient(server.runtime.address, TOKEN) as control:
            await control.retire("x", time.time() + 30, [EpisodeId("r1")])
        async with asyncio.timeout(WAIT):
            return await run


async def test_a_retire_of_an_in_flight_agent_rollout_is_a_clean_409() -> None:
    held = Held()
    async with running(held.app("/ng-rollout/{key}/seed_session")) as resources_url:
        server, app = agent_app(resources_url)
        async with running(app) as url:
            with watched_logs() as logs:
                reply = await retire_in_flight(server, url, held)
            held.release.set()
    assert reply.status_code == 409, reply.text
    assert reply.json()["error"]["code"] == "stale_attempt"
    assert logs.noisy() == []
    (line,) = logs.endings()
    assert line.levelno == logging.INFO and "retired" in line.getMessage()


async def test_a_retire_of_an_in_flight_environment_rollout_is_a_clean_409() -> None:
    held = Held()
    async with running(held.app("/ng-rollout/{key}/run")) as agent_url:
        server, app = environment_app(agent_url)
        async with running(app) as url:
            with watched_logs() as logs:
                reply = await retire_in_flight(server, url, held)
            held.release.set()
    assert reply.status_code == 409, reply.text
    assert reply.json()["error"]["code"] == "stale_attempt"
    assert logs.noisy() == []
    (line,) = logs.endings()
    assert line.levelno == logging.INFO and "retired" in line.getMessage()


# -- the middleware alone: which cancellations it ends, which it lets through --------------

SCOPE: Scope = {"type": "http", "method": "POST", "path": "/ng-rollout/r1/run", "headers": []}


class Endpoint:
    """An ASGI app that signals it runs, then waits forever (or fails as told)."""

    def __init__(self, *, start_response: bool = False, fail: BaseException | None = None):
        self.entered = asyncio.Event()
        self.start_response = start_response
        self.fail = fail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.start_response:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
        self.entered.set()
        if self.fail is not None:
            raise self.fail
        await asyncio.Event().wait()


async def run_middleware(endpoint: Endpoint) -> tuple[asyncio.Task[None], list[Message]]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    task = asyncio.ensure_future(RequestEndingsMiddleware(endpoint)(SCOPE, receive, send))
    async with asyncio.timeout(WAIT):
        await endpoint.entered.wait()
    return task, sent


async def test_a_cancellation_of_its_own_work_ends_the_request_with_a_409() -> None:
    endpoint = Endpoint()
    task, sent = await run_middleware(endpoint)
    cancel_request(task, "stale_attempt", "attempt r1 was retired")
    await task  # ends normally
    assert task.cancelling() == 0
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 409 and b"stale_attempt" in sent[1]["body"]


async def test_a_started_response_is_ended_not_refused() -> None:
    endpoint = Endpoint(start_response=True)
    task, sent = await run_middleware(endpoint)
    cancel_request(task, "stale_attempt", "attempt r1 was retired")
    await task
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]


async def test_a_shutdown_cancellation_propagates() -> None:
    task, sent = await run_middleware(Endpoint())
    task.cancel()  # as uvicorn does when the graceful shutdown times out
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent == []


async def test_a_shutdown_that_coincides_with_a_retire_still_propagates() -> None:
    task, sent = await run_middleware(Endpoint())
    cancel_request(task, "stale_attempt", "attempt r1 was retired")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent == []


async def test_a_client_disconnect_is_a_clean_end() -> None:
    with watched_logs() as logs:
        task, sent = await run_middleware(Endpoint(fail=ClientDisconnect()))
        await task
    assert sent == [] and logs.noisy() == []
    assert [r.levelno for r in logs.endings()] == [logging.INFO]
