"""What the example agent and environment share: reading a body and a callee's refusal,
answering one, and passing a callee's failure on as a failure.

A run that a callee failed answers a failure itself, never a 200: a trainer (or `collect`)
reads the status code, and a success that wraps an error would count a failed rollout as
finished. The status is the callee's (its 4xx or 5xx), 502 for a callee that cannot be
reached, 504 for one that did not answer in time; the body is the usual typed error
(`failure_response`)."""

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


class CalleeFailed(Exception):
    """A callee answered a failure that ends the run: passed on with the callee's `status`."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail

    @classmethod
    def answered(cls, what: str, response: httpx.Response) -> CalleeFailed:
        """The callee's reply to `what` was a failure: its status (502 for a 2xx or 3xx
        that cannot be used, a reply a gateway could not make sense of), its text as the
        detail."""
        status = response.status_code if response.status_code >= 400 else 502
        return cls(status, f"{what} answered {response.status_code}: {response.text[:200]}")


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
    the episode (and logging a traceback) because a callee's process died.

    A callee that took the request and did not answer in time (`timed_out`) is raised
    instead: it is alive, re-issuing would only wait as long again, and the caller answers
    504 (`failure_response`)."""
    try:
        return await http.post(url, **request)
    except httpx.TransportError as error:
        if timed_out(error):
            raise
        detail = f"{type(error).__name__} calling {url}"
        return httpx.Response(409, json={"error": {"code": UNREACHABLE, "detail": detail}})


def timed_out(error: httpx.TransportError) -> bool:
    """Whether the callee was reached and did not answer in time. A connect timeout is not:
    nothing reached the callee (down, or being replaced), like a refused connection."""
    return isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout)


def failure_response(
    failure: CalleeFailed | CalleeUnreachable | httpx.TransportError, **fields: Any
) -> JSONResponse:
    """The reply of a run that a callee failed, with `fields` beside the error (what makes
    it attributable): the callee's status (`upstream_failed`), 504 for a callee that did not
    answer in time (`upstream_timeout`), 502 for one that could not be reached or went away
    mid-call (`upstream_unreachable`)."""
    if isinstance(failure, CalleeFailed):
        status, code, detail = failure.status, "upstream_failed", failure.detail
    elif isinstance(failure, CalleeUnreachable):
        status, code, detail = 502, "upstream_unreachable", str(failure)
    elif timed_out(failure):
        status, code, detail = 504, "upstream_timeout", type(failure).__name__
    else:
        status, code, detail = 502, "upstream_unreachable", type(failure).__name__
    return JSONResponse({**fields, "error": {"code": code, "detail": detail}}, status_code=status)


def json_reply(what: str, response: httpx.Response) -> dict[str, Any]:
    """A callee's successful reply as a JSON object; `CalleeFailed` (the callee's status, or
    502 for a 2xx that is not a JSON object) otherwise, so a callee's failure or a garbled
    reply ends the run as a failure instead of a 500 with a traceback."""
    body = reply_object(response)
    if response.status_code != 200 or body is None:
        raise CalleeFailed.answered(what, response)
    return body


def reply_object(response: httpx.Response) -> dict[str, Any] | None:
    """A callee's reply body as a JSON object; None when it is anything else (not JSON,
    nested deeper than the parser goes, a list, a bare value): a reply's shape is the
    callee's to get wrong, never a 500 with a traceback here."""
    try:
        body = response.json()
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def refusal_code(response: httpx.Response) -> str | None:
    """The `error.code` of a 409 data-plane refusal (`admission_closed`, `awaiting_restore`,
    `stale_attempt`)."""
    return error_code(response) if response.status_code == 409 else None


def error_code(response: httpx.Response) -> str | None:
    """The `error.code` of a typed error reply `{"error": {"code", "detail"}}`, else None."""
    body = reply_object(response)
    error = body.get("error") if body is not None else None
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
