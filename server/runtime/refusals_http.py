"""The data plane's refusal response, written once.

Every data-plane refusal of every kind (`admission_closed`, `stale_attempt`,
`episode_mismatch`, `awaiting_restore`, `shutting_down`, `invalid_rollout_prefix`, a retired
request's own end) is the same JSON body, `{"error": {"code": ..., "detail": ...}}`, so an
agent or a harness can switch on `code` whichever server refused it. Pure ASGI: the
middleware that refuses has no Starlette request object to answer with.
"""

from __future__ import annotations

import json

from starlette.types import Send


async def send_refusal(
    send: Send, status: int, code: str, detail: str, *, retry_after: int | None = None
) -> None:
    """Send a complete JSON refusal (start and body); `retry_after` adds `Retry-After`."""
    body = json.dumps({"error": {"code": code, "detail": detail}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
