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
from collections.abc import Awaitable
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
    """Ends a request that the client left, or that this server cancelled, as the module
    docstring says. The common request pays only for following its response (a plain
    function around `send`, no coroutine of its own); the task is looked up only when a
    request is cancelled or some cancellation of this server's is pending: `current_task()`
    and a weak-dictionary pop on every request cost more than the rest of the layer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = complete = False

        def follow(message: Message) -> Awaitable[None]:
            """What the app sent: to end the response properly whatever point it reached."""
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            return send(message)

        try:
            await self.app(scope, receive, follow)
        except ClientDisconnect:
            log.info("%s: the client went away before its request was read", _describe(scope))
        except asyncio.CancelledError:
            own = take_own_cancellation(asyncio.current_task())
            if own is None:
                raise
            log.info("%s ended early: %s", _describe(scope), own.detail)
            # A refusal when nothing was sent yet; the end of the body when it was started
            # (a truncated stream reads as ended, not as a server error).
            if not started:
                await send_refusal(follow, 409, own.code, own.detail)
            elif not complete:
                await follow({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if _OWN:  # a cancellation of ours that this task never saw must not outlive it
                task = asyncio.current_task()
                if task is not None:
                    _OWN.pop(task, None)


def _describe(scope: Scope) -> str:
    return f"{scope.get('method', '')} {scope.get('path', '')}"
