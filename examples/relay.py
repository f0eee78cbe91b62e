"""What the example agent and environment share: reading a callee's refusal, answering one."""

from __future__ import annotations

import httpx
from fastapi.responses import JSONResponse


def refusal_code(response: httpx.Response) -> str | None:
    """The `error.code` of a 409 data-plane refusal (`admission_closed`, `stale_attempt`)."""
    if response.status_code != 409:
        return None
    try:
        code = response.json().get("error", {}).get("code")
    except ValueError:
        return None
    return str(code) if code else None


def error_response(status: int, code: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "detail": detail}}, status_code=status)
