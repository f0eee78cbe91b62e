"""The policy model's JSON bodies in and typed errors out (`{"error": {"code", "detail"}}`).

One error shape for the scripted model and the proxy alike, so an agent reads a refused
request the same whichever answers it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response

from .policy import PolicyError, compact_json


def json_object_of(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise PolicyError("invalid_json", "the body is not JSON") from None
    if not isinstance(body, dict):
        raise PolicyError("invalid_json", "the body must be a JSON object")
    return body


def error_reply(status: int, code: str, detail: str) -> Response:
    return Response(
        compact_json({"error": {"code": code, "detail": detail}}),
        status_code=status,
        media_type="application/json",
    )
