"""What the example agent and environment share: reading a body and a callee's refusal,
answering one."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

CLOSED_CODES = frozenset({"admission_closed", "awaiting_restore"})
"""The refusals that mean "closed for now, retry the same call after resume": a checkpoint
in progress, or a `start_closed` callee waiting for its Restore or Resume. Nothing ran."""


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
