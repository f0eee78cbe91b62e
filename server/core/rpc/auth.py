"""Bearer-token authentication for the control services (ParticipantService, CoordinatorService).

Every control call needs `authorization: Bearer <token>`; health (the kubelet sends no token)
and reflection (off unless configured) are exempt. The comparison is constant-time so a
caller cannot learn the token byte by byte from timings, and the token never appears in a log
line or a status message. A refused call is answered TOKEN_INVALID in the shape of the method
(all four handler shapes) before a byte of its request is read.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeAlias

import grpc
from grpc import aio

from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.rpc.standard_services import RateLimitedLog
from rollout_checkpoint.server.core.rpc.status import to_grpc_status

log = logging.getLogger(__name__)

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def token_matches(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode(), expected.encode())


def refusal_log(logger: logging.Logger = log) -> Callable[[str], None]:
    """The default refusal hook: one WARNING per minute at most, however fast refused calls
    arrive (anyone who can reach the port can send them)."""
    limited = RateLimitedLog(logger)

    def refused(method: str) -> None:
        limited.warning("refused %s: missing or invalid bearer token", method)

    return refused


class BearerTokenInterceptor(aio.ServerInterceptor):
    """`on_refusal(method)` is called for every refused call (default: `refusal_log()`)."""

    def __init__(
        self,
        token: str,
        exempt_prefixes: Collection[str] = EXEMPT_PREFIXES,
        *,
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        if not token:
            raise ValueError("a control token is required")
        self._token = token
        self._exempt = tuple(exempt_prefixes)
        self._on_refusal = on_refusal if on_refusal is not None else refusal_log()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method or ""
        if method.startswith(self._exempt) or self._authorized(handler_call_details):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: let grpc answer UNIMPLEMENTED
            return None
        self._on_refusal(method)
        return _refusing_handler(handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                presented = value
                break
        scheme, _, token = presented.partition(" ")
        # Compare even when the scheme is wrong, so timing says nothing about which part failed.
        matches = token_matches(token.strip(), self._token)
        return scheme.lower() == "bearer" and matches


_REFUSAL = CheckpointError(Reason.TOKEN_INVALID, "missing or invalid bearer token")


def _refusing_handler(handler: Handler) -> Handler:
    """A handler of the same shape that refuses with TOKEN_INVALID before reading anything."""

    async def refuse_unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(to_grpc_status(_REFUSAL))

    async def refuse_stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(to_grpc_status(_REFUSAL))
        yield  # pragma: no cover - makes this an async generator

    deserializer = handler.request_deserializer
    serializer = handler.response_serializer
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse_unary, deserializer, serializer)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(refuse_unary, deserializer, serializer)
