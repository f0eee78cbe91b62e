"""Idle HTTP connections: how long our servers keep one open, how long our clients reuse one.

A server closes a keep-alive connection once it sat idle for its timeout. A client that sends
a request on that connection in the same instant gets no reply at all (httpx: `ReadError` or
`RemoteProtocolError`) and cannot tell whether the request ran; for a rollout's `/run` that is
a failed attempt, recorded failed under `--max-attempts 1`, for a fault of no one's. uvicorn
and httpx both default to 5 s, so every pause of about 5 s (a checkpoint, an in-place
recovery, a member stopped past its lease) made the next burst of requests race the server's
timer. The rule that removes the race, kept in this one place: every client of ours drops an
idle connection well before any server would close it, and every server of ours keeps one
well past that. The client's bound is below 5 s, the default of uvicorn and of Node's http
server, so a user's own server (or a model server) left at its defaults is safe as well."""

from __future__ import annotations

from typing import Final

import httpx

SERVER_IDLE_SECONDS: Final = 30
"""How long our servers (uvicorn's `timeout_keep_alive`) keep an idle connection open."""

CLIENT_IDLE_SECONDS: Final = 2.0
"""How long our HTTP clients reuse an idle connection (httpx's `keepalive_expiry`): below
every server's keep-alive we know of (5 s is the lowest default), with room for a loaded
machine's scheduling delay between the client's check and its write."""


def client_limits(
    max_connections: int | None = 100, max_keepalive_connections: int | None = 20
) -> httpx.Limits:
    """httpx's pool limits with the idle bound above (the counts default to httpx's own)."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=CLIENT_IDLE_SECONDS,
    )
