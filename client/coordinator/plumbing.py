"""What the coordinator needs to be a well-behaved gRPC server: auth, rich errors, handlers.

The coordinator lives on the controller side, which never imports the participant runtime,
so it carries its own (small) versions of the bearer-token check and of the
`google.rpc.Status` + `ErrorInfo` encoding. The contract they follow is the same one:
`errors.proto` and the conventions of `participant_service.proto`.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc import aio
from grpc_status import rpc_status

from rollout_checkpoint.client.coordination import FleetError
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.tracing import server_span

log = logging.getLogger(__name__)

ERROR_DOMAIN = "rollout-checkpoint.dev"
METADATA_KEY = re.compile(r"[a-z][a-zA-Z0-9\-_]+")
MAX_METADATA_KEY_LENGTH = 64
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Context = aio.ServicerContext[bytes, Any]
Req = TypeVar("Req", bound=Message)


class ServiceError(Exception):
    """A refusal decided by the coordinator itself (reason from errors.proto)."""

    def __init__(
        self,
        reason: str,
        code: str,
        message: str,
        metadata: dict[str, str] | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code
        self.message = message
        self.metadata = dict(metadata or {})
        self.field = field
        if field is not None:
            self.metadata.setdefault("field", field)


def is_metadata_key(key: str) -> bool:
    """Whether `key` may be an `ErrorInfo.metadata` key: google.rpc's rule
    `[a-z][a-zA-Z0-9-_]+`, at most 64 characters (errors.proto promises lowerCamelCase)."""
    return len(key) <= MAX_METADATA_KEY_LENGTH and METADATA_KEY.fullmatch(key) is not None


def fleet_metadata(error: FleetError) -> dict[str, str]:
    """The ErrorInfo metadata of a fleet refusal (documented in errors.proto).

    `failedMembers` names every member that refused or could not be reached, each with its
    reason; `operation` names the fleet operation. When exactly one member refused, its own
    metadata follows with each key prefixed `member` (`checkpointId` -> `memberCheckpointId`):
    a prefix with a separator such as `member.` would break the key rule that controllers in
    other languages may enforce. A member key that would not be a valid key is left out."""
    metadata = {"failedMembers": error.failed_members(), "operation": error.operation}
    only = next(iter(error.failures.values()))
    if len(error.failures) == 1 and only.reason is not None:
        for key, value in only.metadata.items():
            prefixed = "member" + key[:1].upper() + key[1:]
            if is_metadata_key(prefixed):
                metadata[prefixed] = value
    return metadata


def invalid_request(field: str, message: str) -> ServiceError:
    return ServiceError("INVALID_REQUEST", "INVALID_ARGUMENT", f"{field}: {message}", field=field)


def status_of(error: BaseException) -> status_pb2.Status:
    """The `google.rpc.Status` (with one ErrorInfo) a controller receives for `error`."""
    if isinstance(error, ServiceError):
        return _status(error.code, error.reason, error.message, error.metadata, error.field)
    if isinstance(error, FleetError):
        return _status(error.code.name, error.reason, str(error), fleet_metadata(error), None)
    if isinstance(error, ControlError):
        reason = error.reason or "PARTICIPANT_UNREACHABLE"
        metadata = {k: v for k, v in error.metadata.items() if is_metadata_key(k)}
        return _status(error.code.name, reason, error.message, metadata, None)
    log.exception("unexpected failure in a coordinator RPC", exc_info=error)
    return _status(
        "INTERNAL", "INTERNAL_ERROR", f"internal error ({type(error).__name__})", {}, None
    )


def _status(
    code: str, reason: str, message: str, metadata: dict[str, str], field: str | None
) -> status_pb2.Status:
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))
    ]
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    return status_pb2.Status(code=code_pb2.Code.Value(code), message=message, details=details)


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


async def abort(context: Context, error: BaseException) -> None:
    await context.abort_with_status(rpc_status.to_status(status_of(error)))


def parse(request_type: type[Req], raw: bytes) -> Req:
    try:
        return request_type.FromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ServiceError(
            "INVALID_REQUEST",
            "INVALID_ARGUMENT",
            f"the request bytes do not parse as {request_type.DESCRIPTOR.full_name}",
            field="request",
        ) from exc


def unary(request_type: type[Req], method: Callable[[Req], Awaitable[Message]]) -> Handler:
    """A unary handler that parses the bytes itself and turns every failure into a rich status."""

    span_name = _span_name(request_type)

    async def handle(raw: bytes, context: Context) -> Message | None:
        # A span per call, parented to the caller's `traceparent`: the participant calls
        # made inside carry it on, so one fleet checkpoint is one trace.
        with server_span(span_name, context.invocation_metadata()) as span:
            try:
                request = parse(request_type, raw)
                _tag(span, request)
                return await method(request)
            except (aio.AbortError, aio.UsageError):
                raise
            except Exception as error:
                await abort(context, error)
        return None

    return grpc.unary_unary_rpc_method_handler(handle, None, _serialize)


def server_stream(
    request_type: type[Req], method: Callable[[Req], AsyncIterator[Message]]
) -> Handler:
    span_name = _span_name(request_type)

    async def handle(raw: bytes, context: Context) -> AsyncIterator[Message]:
        with server_span(span_name, context.invocation_metadata()) as span:
            try:
                request = parse(request_type, raw)
                _tag(span, request)
                async for message in method(request):
                    yield message
            except (aio.AbortError, aio.UsageError):
                raise
            except Exception as error:
                await abort(context, error)

    return grpc.unary_stream_rpc_method_handler(handle, None, _serialize)


def _span_name(request_type: type[Message]) -> str:
    """`rollout_checkpoint.v1.CoordinatorService/Commit` from `CoordinatorServiceCommitRequest`."""
    rpc = request_type.DESCRIPTOR.name.removeprefix("CoordinatorService").removesuffix("Request")
    return f"rollout_checkpoint.v1.CoordinatorService/{rpc}"


def _tag(span: Any, request: Message) -> None:
    checkpoint_id = getattr(request, "checkpoint_id", "")
    if span is not None and checkpoint_id:
        span.set_attribute("rollout_checkpoint.checkpoint_id", checkpoint_id)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class BearerTokenInterceptor(aio.ServerInterceptor):
    """Every coordinator call needs `authorization: Bearer <token>`; health is exempt."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("a control token is required")
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(("/grpc.health.v1.Health/", "/grpc.reflection.")):
            return handler
        if self._authorized(handler_call_details):
            return handler
        refusal = ServiceError(
            "TOKEN_INVALID", "UNAUTHENTICATED", "missing or invalid bearer token"
        )

        async def refuse(request: Any, context: Context) -> Any:
            await abort(context, refusal)

        async def refuse_stream(request: Any, context: Context) -> AsyncIterator[Any]:
            await abort(context, refusal)
            yield  # pragma: no cover

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                presented = value
                break
        scheme, _, token = presented.partition(" ")
        matches = hmac.compare_digest(token.strip().encode(), self._token)
        return scheme.lower() == "bearer" and matches


class RateLimitedLog:
    """At most one WARNING per `interval` seconds for events anyone can cause at will (the
    coordinator's copy of server/logs.py's; keep them in step).

    The first event is logged at once; later ones within the interval are only counted, and
    the count rides on the next line logged after the interval."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._quiet_until: float | None = None
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = self._clock()
        if self._quiet_until is not None and now < self._quiet_until:
            self._suppressed += 1
            return
        if self._suppressed:
            message += " (%d more since the last such line, not logged)"
            args = (*args, self._suppressed)
        self.logger.warning(message, *args)
        self._suppressed = 0
        self._quiet_until = now + self.interval
