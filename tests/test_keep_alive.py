"""Idle connections: a client of ours never sends on a connection its server is closing.

The defect this guards: uvicorn and httpx both kept an idle connection 5 s, so a burst of
`/run`s sent about 5 s after the last replies (an in-place recovery took 5.00 s) raced the
server's timer; a request written as the server closed got no reply (`ReadError`) and, under
`--max-attempts 1`, its rollout was recorded failed for a crash it had no part in."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import httpx
import pytest

from rollout_checkpoint.server.core.keep_alive import (
    CLIENT_IDLE_SECONDS,
    SERVER_IDLE_SECONDS,
    client_limits,
)

ROOT = Path(__file__).resolve().parents[1]
SERVER_CLOSES_AFTER = CLIENT_IDLE_SECONDS + 0.4
"""A server whose keep-alive is just above our clients' bound (5 s, uvicorn's default, is far
above it): the tightest server our clients must still be safe against."""


class ClosingServer:
    """An HTTP/1.1 server that answers every request with 200, keeps the connection, and
    emulates its keep-alive timer firing exactly as a late request arrives: a request on a
    connection idle for `closes_after` or longer is not answered, the connection is closed.
    That is the race, made deterministic."""

    def __init__(self, closes_after: float) -> None:
        self.closes_after = closes_after
        self.connections = 0
        self.unanswered = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ClosingServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        idle_since = time.monotonic()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if time.monotonic() - idle_since >= self.closes_after:
                    self.unanswered += 1
                    return
                body = b"ok"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                idle_since = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def two_requests_apart(limits: httpx.Limits, server: ClosingServer) -> None:
    """A request, an idle gap past the server's keep-alive, another request."""
    url = f"http://127.0.0.1:{server.port}/run"
    async with httpx.AsyncClient(limits=limits, timeout=10) as http:
        assert (await http.post(url, json={"n": 1})).status_code == 200
        await asyncio.sleep(server.closes_after + 0.2)  # the idle gap is what is tested
        assert (await http.post(url, json={"n": 2})).status_code == 200


async def test_a_client_that_keeps_idle_connections_as_long_as_its_server_gets_no_reply() -> None:
    """The control: httpx's default (5 s, what the collector used) against the server above
    reuses the connection the server is closing, and the request gets no reply at all."""
    async with ClosingServer(SERVER_CLOSES_AFTER) as server:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await two_requests_apart(httpx.Limits(), server)
        assert server.unanswered == 1


async def test_our_clients_open_a_new_connection_before_the_server_closes_the_idle_one() -> None:
    async with ClosingServer(SERVER_CLOSES_AFTER) as server:
        await two_requests_apart(client_limits(), server)
        assert (server.connections, server.unanswered) == (2, 0)


def calls_to(names: set[str]) -> list[tuple[str, ast.Call]]:
    """Every call of `httpx.AsyncClient(...)`-like names in the product's source."""
    found = []
    for folder in ("server", "client", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and f"{node.func.value.id}.{node.func.attr}" in names
                ):
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node))
    return found


def test_every_http_client_of_the_product_drops_idle_connections_early() -> None:
    """A client over the network passes `limits` (an in-process ASGI transport has no idle
    connection to race), and the only pool limits made anywhere are `client_limits`'."""
    calls = calls_to({"httpx.AsyncClient", "httpx.Client"})
    assert calls, "no httpx client found: the scan is broken"
    without = [
        where
        for where, call in calls
        if not {k.arg for k in call.keywords} & {"limits", "transport"}
    ]
    assert not without, f"httpx clients at httpx's 5 s idle default: {without}"
    own = [w for w, _ in calls_to({"httpx.Limits"}) if not w.startswith("server/core/keep_alive")]
    assert not own, f"pool limits made without client_limits: {own}"


def test_every_server_of_the_product_keeps_idle_connections_well_past_the_clients() -> None:
    configs = calls_to({"uvicorn.Config"})
    assert configs, "no uvicorn.Config found: the scan is broken"
    missing = [
        where
        for where, call in configs
        if "timeout_keep_alive" not in {k.arg for k in call.keywords}
    ]
    assert not missing, f"uvicorn servers left at the 5 s default keep-alive: {missing}"
    assert SERVER_IDLE_SECONDS >= 5 * CLIENT_IDLE_SECONDS
