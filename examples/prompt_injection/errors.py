"""How the prompt-injection server refuses: an HTTP error with the usual envelope, or a tool's
own failure answered 200.

Two kinds, because an agent must be able to tell a request it got wrong (4xx: its call never
reached the environment) from a tool that ran and failed (200 with an error string: the
model reads it and carries on, as it would against a real tool).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException


class RequestRefused(HTTPException):
    """A request this server refuses with an HTTP status; the body is the usual error envelope
    `{"error": {"code", "detail"}}`. An HTTPException, so a tool called over MCP reports the
    detail as its tool error."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(status_code=status, detail=detail)
        self.code = code


class ToolError(Exception):
    """A tool's own failure: answered 200 with an error string, as an agent expects."""


def no_session_refusal() -> RequestRefused:
    return RequestRefused(400, "no_session", "call seed_session first")
