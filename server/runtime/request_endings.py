"""Requests that end early are normal events: one INFO line, never a logged traceback.

Two ways a data-plane request ends before its handler finishes are part of normal work:

* the client goes away before its body is read (a collector stopped by SIGTERM, a caller
  that timed out): Starlette raises `ClientDisconnect` from `request.body()`;
* this server cancels the request's own work, as a Retire of an in-flight rollout does: the
  handler's task gets a `CancelledError`.

Either one used to escape the app, and uvicorn logged "Exception in ASGI application" with a
traceback for each (and answered a still-connected caller 500). `RequestEndingsMiddleware`, a
pure ASGI middleware the runtime installs for every kind, ends both cleanly with one INFO
line; a retired request whose caller is still there gets the data plane's own refusal
(409 `stale_attempt`), which callers already handle.

A cancellation this server did not ask for (uvicorn cancelling its tasks at shutdown, or
anyone else) is never swallowed: only a task whose every pending cancellation came through
`cancel_request` is treated as ended. `Task.cancelling()` counts the requests, so a shutdown
that cancels a request which a retire also cancelled still propagates.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_checkpoint.server.runtime.refusals_http import send_refusal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnCancellation:
    """Why this server cancelled a request's work, and the refusal its caller gets."""

    code: str
    detail: str
    requests: int = 1
    """How many times `cancel_request` cancelled the task (matched against `cancelling()`)."""


_OWN: weakref.WeakKeyDictionary[asyncio.Task[Any], OwnCancellation] = weakref.WeakKeyDictionary()


def cancel_request(task: asyncio.Task[Any], code: str, detail: str) -> None:
    """Cancel the task serving a request, for a reason of this server's own (a retire).

    The request then ends with a 409 `{"error": {"code": code, "detail": detail}}` (when its
    caller is still connected and nothing was sent yet) and one INFO line."""
    previous = _OWN.get(task)
    _OWN[task] = OwnCancellation(code, detail, 1 + (previous.requests if previous else 0))
    task.cancel()


def take_own_cancellation(task: asyncio.Task[Any] | None) -> OwnCancellation | None:
    """The reason when every pending cancellation of `task` is this server's own, after
    withdrawing them (so the task can finish normally); None when anyone else (a shutdown)
    cancelled it too, or nobody asked: then the cancellation must propagate."""
    if task is None:
        return None
    own = _OWN.pop(task, None)
    if own is None or task.cancelling() > own.requests:
        return None
    while task.cancelling():
        task.uncancel()
    return own


class RequestEndingsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _ResponseProgress(send)
        task = asyncio.current_task()
        try:
            await self.app(scope, receive, response.send)
        except ClientDisconnect:
            log.info("%s: the client went away before its request was read", _describe(scope))
        except asyncio.CancelledError:
            own = take_own_cancellation(task)
            if own is None:
                raise
            log.info("%s ended early: %s", _describe(scope), own.detail)
            await response.finish(own)
        finally:
            if task is not None:
                _OWN.pop(task, None)


class _ResponseProgress:
    """Follows what the app sent, to end the response properly whatever point it reached."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def finish(self, own: OwnCancellation) -> None:
        """A refusal when nothing was sent yet; the end of the body when it was started (a
        truncated stream reads as ended, not as a server error)."""
        if not self.started:
            await send_refusal(self.send, 409, own.code, own.detail)
        elif not self.complete:
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})


def _describe(scope: Scope) -> str:
    return f"{scope.get('method', '')} {scope.get('path', '')}"
