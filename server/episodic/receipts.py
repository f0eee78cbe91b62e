"""Completion receipts: a finished result goes into the outbox before its reply goes out.

`ResultReceiptMiddleware` acts only on a request under a rollout prefix that carries
`x-rollout-receipt: request` (the trainer's own call of the entry route, `/run`; a relay
between fleet servers asks for none, so nothing is held twice). For such a request:

1. If the outbox holds a result of the same rollout and route, the request gets that result
   at once and the app never sees it (`x-rollout-result-source: outbox`): a reply that was
   lost, or a result restored from a checkpoint, is offered again instead of run again.
   A result held for another request of the rollout (another task: the body's canonical
   JSON differs) is never served for it: 409 `request_mismatch`, typed, nothing run.
2. Else, if the outbox is full, the request is refused before anything runs: HTTP 429
   `outbox_full` with `Retry-After` (the trainer acknowledges, then retries).
3. Else the app runs. A 200 reply with a JSON body is held back until its result is in the
   outbox under a receipt, then sent with the receipt in `x-rollout-receipt` (JSON:
   `rollout_id`, `attempt`, `result_sha256`, `lineage`). Put first, send second: a trainer
   that received the reply always finds the result held until it acknowledges it. Any other
   reply (an error, a refusal, a body that is not JSON) passes untouched, with no receipt.

The receipt's digest is of the result's canonical JSON (runtime/result_outbox.py), so the same result
re-offered from the outbox, or restored from a checkpoint, carries the same receipt. The
body is parsed off the event loop when it is large.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from typing import Protocol

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.receipts import Receipt
from rollout_checkpoint.server.runtime.refusals_http import send_refusal
from rollout_checkpoint.server.runtime.result_outbox import (
    HeldResult,
    Lookup,
    Produced,
    canonical_json,
    result_digest,
)
from rollout_checkpoint.server.runtime.rollout_prefix import episode_of

RECEIPT_REQUEST_HEADER = b"x-rollout-receipt"
"""Request header (value `request`): hold this run's result under a receipt."""
RECEIPT_HEADER = b"x-rollout-receipt"
"""Reply header: the receipt, as compact JSON."""
SOURCE_HEADER = b"x-rollout-result-source"
"""Reply header: `run` (this request ran it) or `outbox` (held, offered again)."""
OUTBOX_FULL = "outbox_full"
REQUEST_MISMATCH = "request_mismatch"
OUTBOX_FULL_RETRY_SECONDS = 1
_LONG_DIGITS = re.compile(rb"\d{19,}")
LARGE_BODY = 256 * 1024
"""Bodies past this many bytes are parsed and canonicalized in a thread."""


class OutboxAccess(Protocol):
    """Where the outbox lives: the participant itself, or the main process of a server with
    several workers (one outbox for all of them, so a late run finds its result whichever
    worker it reaches)."""

    async def lookup(self, episode: EpisodeId, route: str) -> Lookup: ...

    async def put(self, produced: Produced) -> Receipt | None:
        """Hold the result; its receipt (lineage stamped where the outbox lives), or None
        when the outbox cannot be reached (the reply then goes out without a receipt)."""
        ...


def asks_receipt(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == RECEIPT_REQUEST_HEADER:
            return bool(value.strip().lower() == b"request")
    return False


class ResultReceiptMiddleware:
    """Holds receipted results in the outbox and answers late runs from it (module docstring)."""

    def __init__(self, app: ASGIApp, outbox: OutboxAccess) -> None:
        self.app = app
        self.outbox = outbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        episode = episode_of(scope) if scope["type"] == "http" else None
        if episode is None or not asks_receipt(scope):
            await self.app(scope, receive, send)
            return
        route: str = scope["path"]
        body, more = await _request_body(receive)
        request = (
            await asyncio.to_thread(request_digest, body)
            if len(body) > LARGE_BODY
            else request_digest(body)
        )
        found = await self.outbox.lookup(episode, route)
        if found.held is not None:
            if found.held.request_sha256 != request:
                await send_refusal(
                    send,
                    409,
                    REQUEST_MISMATCH,
                    f"the result of rollout {episode.rollout_id} held here answers another "
                    "request (another task): acknowledge it, or run this one under another "
                    "rollout id",
                )
                return
            await send_held(send, found.held)
            return
        if found.full:
            await send_refusal(
                send,
                429,
                OUTBOX_FULL,
                "the result outbox is full: acknowledge held results (AcknowledgeResults), "
                "then retry",
                retry_after=OUTBOX_FULL_RETRY_SECONDS,
            )
            return
        reply = _HeldBackReply(send)
        await self.app(scope, _replayed(body, more, receive), reply.send)
        await reply.release(self.outbox, episode, route, request)


async def send_held(send: Send, held: HeldResult) -> None:
    body = held.canonical.encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (RECEIPT_HEADER, receipt_header(held.receipt)),
        (SOURCE_HEADER, b"outbox"),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def receipt_header(receipt: Receipt) -> bytes:
    return json.dumps(receipt.as_json(), separators=(",", ":")).encode()


class _HeldBackReply:
    """Holds a 200 JSON reply back until its result is in the outbox; passes anything else."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._complete = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] == 200 and _is_json(message):
                self._start = message
                return
        elif message["type"] == "http.response.body" and self._start is not None:
            self._chunks.append(message.get("body", b""))
            self._complete = not message.get("more_body", False)
            return
        await self._send(message)

    async def release(
        self, outbox: OutboxAccess, episode: EpisodeId, route: str, request: str
    ) -> None:
        """After the app returned: hold the result and send the reply with its receipt."""
        if self._start is None:
            return
        body = b"".join(self._chunks)
        headers = list(self._start.get("headers", ()))
        if self._complete:
            canonical = await _canonical(body)
            receipt = (
                None
                if canonical is None
                else await outbox.put(Produced(episode, route, request, *canonical))
            )
            if receipt is not None:
                headers += [(RECEIPT_HEADER, receipt_header(receipt)), (SOURCE_HEADER, b"run")]
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})


def _is_json(start: Message) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return bool(value.split(b";")[0].strip().lower() == b"application/json")
    return False


async def _canonical(body: bytes) -> tuple[str, str] | None:
    """The canonical JSON of a reply body and its digest, or None when it is no JSON."""
    if len(body) > LARGE_BODY:
        return await asyncio.to_thread(_canonical_now, body)
    return _canonical_now(body)


def _canonical_now(body: bytes) -> tuple[str, str] | None:
    """orjson parses a reply about 2.5x faster than the standard library, but reads an
    integer past 64 bits as a float, silently: a body with a run of 19 digits or more
    (possibly such an integer) is parsed by the standard library, which keeps it exact."""
    try:
        if _LONG_DIGITS.search(body):
            value = json.loads(body, parse_constant=_not_json)
        else:
            value = orjson.loads(body)
    except (ValueError, TypeError, RecursionError):  # orjson.JSONDecodeError is a ValueError
        return None
    try:
        canonical = canonical_json(value)
    except (ValueError, TypeError, RecursionError):
        return None
    return canonical, result_digest(canonical)


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is no JSON")


def request_digest(body: bytes) -> str:
    """What a held result remembers of the request that produced it: the SHA-256 of its
    canonical JSON (the same task re-sent by another process, keys in another order, is the
    same request), or of its bytes when it is no JSON."""
    canonical = _canonical_now(body)
    return canonical[1] if canonical is not None else hashlib.sha256(body).hexdigest()


async def _request_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole request body, and any message that came after it (a disconnect)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), [message]
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), []


def _replayed(body: bytes, after: list[Message], receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then what came after it."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}, *after]

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
