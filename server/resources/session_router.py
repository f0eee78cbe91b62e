"""Cookie routing for a resources server with several workers: a session's requests reach
the worker that holds its state.

A resources server keeps each session's tool state in the memory of the process that seeded
it (a patient chart, a counter, a sandbox handle), and the workers share one port, so the
kernel hands a connection to whichever worker accepts it first. A session belongs to worker
`session_owner(id) % workers` (a hash of its id: worker_pool.py), and the worker that seeds
one picks an id it owns (`owned_session_id`); every request then enters through this
middleware, outermost in each worker, and a request whose cookie's session belongs to
another worker is forwarded, as it came, to that worker's own Unix socket (in the server's
private directory), and its reply returned as it went. The owner's whole stack then
runs (prefix, session, admission, counting, the route), exactly as for a request that came
straight to it, so a forwarded request is counted, refused, drained and retired at its owner
only.

A restore places each session by the same hash of the same id, modulo the replacement's own
worker count, and the cookie keeps the id: so a session is found after any restore, from
one process into several, from several into one, or into a different number. Cookies of an
earlier version also name an owner index (`rollout_checkpoint.owner`); it is ignored, as the
restore ignores the `worker` its records carried (records_codec.py).
"""

from __future__ import annotations

import json
import logging
from base64 import b64decode
from typing import Any

import httpx
import itsdangerous
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_checkpoint.server.runtime.refusals_http import send_refusal
from rollout_checkpoint.server.runtime.worker_pool import session_owner

log = logging.getLogger(__name__)

FORWARDED_HEADER = b"x-rollout-checkpoint-forwarded"
"""Marks a request a worker forwarded to the owner: the owner never forwards it again (a
request bouncing between two workers that disagree would otherwise loop)."""
_HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"upgrade",
    b"proxy-connection",
    b"content-length",
}


class SessionRouter:
    """Outermost ASGI middleware of one worker: forward requests of sessions it does not own."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        secret: str,
        cookie: str,
        session_key: str,
        index: int,
        workers: int,
        socket_of: Any,
    ) -> None:
        self.app = app
        self.signer = itsdangerous.TimestampSigner(str(secret))
        self.cookie = cookie
        self.session_key = session_key
        self.index = index
        self.workers = workers
        self._socket_of = socket_of
        self._clients: dict[int, httpx.AsyncClient] = {}
        self.forwarded = 0
        """Requests this worker forwarded to their owner (for the benchmark)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.workers < 2:
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if any(name == FORWARDED_HEADER for name, _ in headers):
            await self.app(scope, receive, send)
            return
        owner = self._owner(headers)
        if owner is None or owner % self.workers == self.index:
            await self.app(scope, receive, send)
            return
        await self._forward(owner % self.workers, scope, receive, send)

    def _owner(self, headers: list[tuple[bytes, bytes]]) -> int | None:
        for name, value in headers:
            if name != b"cookie":
                continue
            data = cookie_parser(value.decode("latin-1")).get(self.cookie)
            if data is None:
                continue
            try:
                session = json.loads(b64decode(self.signer.unsign(data.encode())))
            except (itsdangerous.BadSignature, ValueError):
                return None  # the owner's own session middleware would ignore it too
            if not isinstance(session, dict):
                return None
            session_id = session.get(self.session_key)
            return session_owner(session_id) if isinstance(session_id, str) else None
        return None

    def _client(self, target: int) -> httpx.AsyncClient:
        client = self._clients.get(target)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=self._socket_of(target))
            client = httpx.AsyncClient(transport=transport, timeout=None)
            self._clients[target] = client
        return client

    async def _forward(self, target: int, scope: Scope, receive: Receive, send: Send) -> None:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        url = f"http://worker{target}{path.decode('latin-1')}"
        if query:
            url += "?" + query.decode("latin-1")
        headers = [(n, v) for n, v in scope["headers"] if n.lower() not in _HOP_BY_HOP]
        headers.append((FORWARDED_HEADER, str(self.index).encode()))
        self.forwarded += 1
        try:
            reply = await self._client(target).request(
                scope["method"], url, headers=headers, content=bytes(body)
            )
        except httpx.TransportError as error:
            # The owner is gone (it died and is being restarted): the session's state died
            # with it, and a retry reaches the restarted worker, which says so itself.
            log.warning("worker %d: forwarding to worker %d failed: %r", self.index, target, error)
            await send_refusal(
                send,
                503,
                "worker_unavailable",
                f"worker {target}, which holds this session, is not running; retry",
                retry_after=1,
            )
            return
        content = reply.content  # decoded: so its encoding header goes too
        out = [
            (n.lower(), v)
            for n, v in reply.headers.raw
            if n.lower() not in _HOP_BY_HOP and n.lower() != b"content-encoding"
        ]
        out.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": reply.status_code, "headers": out})
        await send({"type": "http.response.body", "body": content})
