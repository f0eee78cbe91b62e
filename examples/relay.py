"""What the example agent and environment share: reading a body and a callee's refusal,
answering one."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

UNREACHABLE = "callee_unreachable"
"""What `post_replayable` reports for a callee that cannot be reached (down, or being replaced)."""

CLOSED_CODES = frozenset({"admission_closed", "awaiting_restore", UNREACHABLE})
"""The refusals that mean "closed for now, retry the same call after resume": a checkpoint
in progress, a `start_closed` callee waiting for its Restore or Resume, or a callee that
cannot be reached at all (its replacement will be restored). Nothing ran here, so the caller
stays at its boundary: if the fleet is restored meanwhile, the recovery retires this attempt
and the controller continues the rollout from the checkpoint."""


class CalleeUnreachable(Exception):
    """A callee stayed unreachable longer than the caller waits for it (`UnreachableClock`)."""


class UnreachableClock:
    """How long a re-issuable call has found its callee unreachable in a row.

    A replacement being restored answers again within seconds, so the caller waits at its
    boundary; a callee that never comes back (a wrong URL, a dead host) must still fail the
    episode after `limit` seconds, not hold the request forever."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._since: float | None = None

    def saw(self, code: str | None) -> None:
        """Note one attempt's outcome; raise `CalleeUnreachable` past the limit."""
        if code != UNREACHABLE:
            self._since = None
            return
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif now - self._since > self.limit:
            raise CalleeUnreachable(f"the callee was unreachable for more than {self.limit:g} s")


async def post_replayable(http: httpx.AsyncClient, url: str, **request: Any) -> httpx.Response:
    """POST a call that is safe to re-issue (a replay step); a transport failure becomes a
    409 `callee_unreachable` refusal, so the caller waits at its boundary instead of failing
    the episode (and logging a traceback) because a callee's process died."""
    try:
        return await http.post(url, **request)
    except httpx.TransportError as error:
        detail = f"{type(error).__name__} calling {url}"
        return httpx.Response(409, json={"error": {"code": UNREACHABLE, "detail": detail}})


def refusal_code(response: httpx.Response) -> str | None:
    """The `error.code` of a 409 data-plane refusal (`admission_closed`, `awaiting_restore`,
    `stale_attempt`)."""
    if response.status_code != 409:
        return None
    try:
        body = response.json()
    except (ValueError, RecursionError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code else None


async def json_object(request: Request) -> dict[str, Any] | None:
    """The body as a JSON object; None when it is not one (the caller answers 400): a body
    that does not parse is the caller's mistake, never a 500 with a logged traceback."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def error_response(status: int, code: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "detail": detail}}, status_code=status)
