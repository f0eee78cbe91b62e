"""The local bridge between a multi-worker server's main process and its workers.

One Unix stream socket per worker, in a directory only this user can enter (see
`workers.py`): the main process listens, each worker connects once and keeps the connection
for its whole life. A frame is a 4-byte big-endian length and one JSON object:

    {"id": 7, "op": "export", "body": {...}}        a call; the other side replies once
    {"id": null, "op": "state", "body": {...}}      a message; no reply
    {"reply_to": 7, "ok": true, "body": ...}
    {"reply_to": 7, "ok": false, "error": {"reason": "INVALID_PHASE", "message": ..., ...}}

Both sides call and both answer, on one connection, so a message sent before a reply is read
before it (a worker pushes its readiness, then answers the install that changed it: the
main process never sees the answer before the state it implies). A refusal with a reason
(`CheckpointError`) crosses the socket as itself, so a controller gets the worker's reason
unchanged; any other failure arrives as `WorkerCallFailed` (HOOK_FAILED for the control
plane, like any other hook failure). The JSON keeps object key order and integers of any
size, as the records on disk do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_checkpoint.server.core.errors import CheckpointError, Reason

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 30
"""Only to reject a corrupt length prefix: a real frame (a worker's exported records) is
far smaller, and a length beyond this means the stream is out of step."""
_HEADER = struct.Struct(">I")

Handler = Callable[[str, Any], Awaitable[Any]]
"""Answers a call: (op, body) -> reply body; raise to refuse."""
Listener = Callable[[str, Any], None]
"""Takes a message (no reply) on the read loop, in order: it must not block or await."""


class WorkerCallFailed(Exception):
    """The other side failed a call without a reason of ours (its own exception's type and
    message, which name no state), or the connection was lost before the reply."""


class LinkClosed(WorkerCallFailed):
    """The connection ended: the worker died, or the main process did."""


class Link:
    """One end of a bridge connection: `call` and `send` out, `run` reads until it ends."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        handler: Handler | None = None,
        listener: Listener | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._listener = listener
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    def send(self, op: str, body: Any = None) -> None:
        """A message that needs no reply; written now (never blocks), in order with calls."""
        self._write({"id": None, "op": op, "body": body})

    async def call(self, op: str, body: Any = None) -> Any:
        """Send a call and wait for its reply body; raises what the other side raised
        (`CheckpointError` with its reason, else `WorkerCallFailed`) or `LinkClosed`."""
        if self.closed:
            raise LinkClosed("the worker connection is closed")
        self._next_id += 1
        call_id = self._next_id
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._write({"id": call_id, "op": op, "body": body})
            return await future
        finally:
            self._pending.pop(call_id, None)

    async def run(self) -> None:
        """Read frames until the connection ends; then every pending call fails
        `LinkClosed` and the calls being answered are cancelled."""
        try:
            while True:
                frame = await self._read()
                if frame is None:
                    return
                self._dispatch(frame)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as error:
            log.warning("worker connection ended: %s", error)
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(LinkClosed("the worker connection was lost"))
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            self._writer.close()

    # -- internals -----------------------------------------------------------------------

    def _write(self, message: dict[str, Any]) -> None:
        if self.closed:
            raise LinkClosed("the worker connection is closed")
        data = json.dumps(message, separators=(",", ":")).encode()
        self._writer.write(_HEADER.pack(len(data)) + data)

    async def _read(self) -> dict[str, Any] | None:
        try:
            header = await self._reader.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as error:
            if not error.partial:
                return None
            raise
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {length} bytes: the stream is out of step")
        message = json.loads(await self._reader.readexactly(length))
        if not isinstance(message, dict):
            raise ValueError("a frame that is not a JSON object")
        return message

    def _dispatch(self, frame: dict[str, Any]) -> None:
        if "reply_to" in frame:
            future = self._pending.get(frame["reply_to"])
            if future is None or future.done():
                return
            if frame.get("ok"):
                future.set_result(frame.get("body"))
            else:
                future.set_exception(_error_from(frame.get("error") or {}))
            return
        op, body, call_id = frame.get("op", ""), frame.get("body"), frame.get("id")
        if call_id is None:
            if self._listener is not None:
                try:
                    self._listener(op, body)
                except Exception:
                    log.exception("a worker message %r failed", op)
            return
        task = asyncio.get_running_loop().create_task(self._answer(call_id, op, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, call_id: int, op: str, body: Any) -> None:
        try:
            if self._handler is None:
                raise WorkerCallFailed(f"no handler for {op!r}")
            result = await self._handler(op, body)
        except asyncio.CancelledError:
            raise
        except CheckpointError as error:
            reply = {"reply_to": call_id, "ok": False, "error": _error_to(error)}
        except Exception as error:
            log.warning("bridge call %r failed: %r", op, error)
            reply = {
                "reply_to": call_id,
                "ok": False,
                "error": {"reason": None, "message": f"{type(error).__name__}: {error}"},
            }
        else:
            reply = {"reply_to": call_id, "ok": True, "body": result}
        with contextlib.suppress(LinkClosed):
            self._write(reply)


def _error_to(error: CheckpointError) -> dict[str, Any]:
    return {
        "reason": error.reason.value,
        "message": error.message,
        "code": error.code,
        "metadata": dict(error.metadata),
    }


def _error_from(error: dict[str, Any]) -> Exception:
    reason = error.get("reason")
    message = str(error.get("message", "the worker failed"))
    if reason is None:
        return WorkerCallFailed(message)
    return CheckpointError(
        Reason(reason),
        message,
        code=error.get("code"),
        metadata={str(k): str(v) for k, v in (error.get("metadata") or {}).items()},
    )
