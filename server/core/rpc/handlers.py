"""One set of gRPC handler adapters for every service of the project.

Handlers are registered with an identity request deserializer and parse the bytes themselves:
grpcio would otherwise answer a request that does not parse with UNKNOWN and no details (and
log a traceback per call), and controllers must always get an `INVALID_REQUEST` they can
switch on. Every failure becomes a `google.rpc.Status`: a `CheckpointError` its own, anything
unexpected `INTERNAL_ERROR` (logged); a service with refusals of its own kinds (the
coordinator relaying its members' reasons) passes its own `status_of`.

An observer sees every call: `observer.operation(method, metadata)` is entered around the
handler, told the request's checkpoint id and the refusal reason, if any. The participant's
`ControlObserver` (metrics, spans, logs) and the coordinator's tracing span both plug in here.

Cancellation: only a handler that is itself being cancelled (the client went away, the server
stops) may end without a status. A CancelledError escaping from work the handler awaited is an
internal error like any other: grpc.aio sends nothing for it, and a client without its own
timeout would hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeAlias, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2
from grpc import aio
from grpc_status import rpc_status

from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.rpc.status import error_info, to_status_proto

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)
Context = aio.ServicerContext[bytes, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Metadata = Iterable[tuple[str, Any]] | None
StatusOf = Callable[[BaseException], status_pb2.Status]


class Call(Protocol):
    """What a handler tells its observer about one call."""

    def checkpoint(self, checkpoint_id: str) -> None: ...

    def refused(self, reason: str) -> None: ...


class CallObserver(Protocol):
    """Wraps every call: `with observer.operation(method, metadata) as call: ...`."""

    def operation(self, method: str, metadata: Metadata = None) -> AbstractContextManager[Call]: ...


def parse(request_type: type[Req], raw: bytes) -> Req:
    """The request message, or INVALID_REQUEST (field `request`) for bytes that do not parse."""
    try:
        return request_type.FromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            Reason.INVALID_REQUEST,
            f"the request bytes do not parse as {request_type.DESCRIPTOR.full_name}",
            field="request",
        ) from exc


def internal_error(exc: BaseException) -> CheckpointError:
    """INTERNAL_ERROR for a failure nobody decided on; the traceback goes to the log."""
    log.exception("unexpected failure in a control RPC", exc_info=exc)
    return CheckpointError(Reason.INTERNAL_ERROR, f"internal error ({type(exc).__name__})")


def checkpoint_status(error: BaseException) -> status_pb2.Status:
    """A CheckpointError's own status; anything else INTERNAL_ERROR."""
    if isinstance(error, CheckpointError):
        return to_status_proto(error)
    return to_status_proto(internal_error(error))


def unary(
    method_name: str,
    request_type: type[Req],
    method: Callable[[Req], Awaitable[Message]],
    observer: CallObserver,
    status_of: StatusOf = checkpoint_status,
) -> Handler:
    """A unary-unary handler that parses its own bytes and answers every failure typed."""

    async def handle(raw: bytes, context: Context) -> Message | None:
        with observer.operation(method_name, context.invocation_metadata()) as call:
            async with _answering(context, call, status_of):
                request = parse(request_type, raw)
                call.checkpoint(getattr(request, "checkpoint_id", ""))
                return await method(request)
        return None

    return grpc.unary_unary_rpc_method_handler(handle, None, serialize)


def server_stream(
    method_name: str,
    request_type: type[Req],
    method: Callable[[Req], AsyncIterator[Message]],
    observer: CallObserver,
    status_of: StatusOf = checkpoint_status,
) -> Handler:
    """A unary-stream handler with the manners of `unary`."""

    async def handle(raw: bytes, context: Context) -> AsyncIterator[Message]:
        with observer.operation(method_name, context.invocation_metadata()) as call:
            async with _answering(context, call, status_of):
                request = parse(request_type, raw)
                call.checkpoint(getattr(request, "checkpoint_id", ""))
                async for message in method(request):
                    yield message

    return grpc.unary_stream_rpc_method_handler(handle, None, serialize)


def service(
    descriptor: ServiceDescriptor,
    implementation: object,
    observer: CallObserver,
    status_of: StatusOf = checkpoint_status,
) -> grpc.GenericRpcHandler:
    """The handler of a whole service, derived from its proto: every method of `descriptor`
    is served by `implementation`'s method of the same name in snake_case (`GetStatus` ->
    `get_status`), a coroutine for a unary method and an async generator for a
    server-streaming one. A method the implementation lacks fails here, at startup."""
    methods: dict[str, Handler] = {}
    for method in descriptor.methods:
        if method.client_streaming:
            raise TypeError(f"{method.full_name}: client streaming is not supported here")
        request_type = message_factory.GetMessageClass(method.input_type)
        serve = getattr(implementation, snake_case(method.name))
        adapter = server_stream if method.server_streaming else unary
        methods[method.name] = adapter(method.name, request_type, serve, observer, status_of)
    return grpc.method_handlers_generic_handler(descriptor.full_name, methods)


def snake_case(name: str) -> str:
    """`GetStatus` -> `get_status`: an RPC's name as a Python method or metric label."""
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


@contextlib.asynccontextmanager
async def _answering(context: Context, call: Call, status_of: StatusOf) -> AsyncIterator[None]:
    """Answer whatever the block raises with a status (see the module's note on cancelling)."""
    try:
        yield
    except (aio.AbortError, aio.UsageError):
        raise
    except asyncio.CancelledError as exc:
        if call_cancelled():
            raise
        await _refuse(context, call, status_of(exc))
    except Exception as exc:
        await _refuse(context, call, status_of(exc))


async def _refuse(context: Context, call: Call, status: status_pb2.Status) -> None:
    info = error_info(status)
    call.refused(info.reason if info is not None else Reason.INTERNAL_ERROR.value)
    await context.abort_with_status(rpc_status.to_status(status))


def call_cancelled() -> bool:
    """Whether the handler itself is being cancelled (the client went away, the server
    stops), as opposed to a CancelledError escaping from work it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def serialize(message: Message) -> bytes:
    return message.SerializeToString()
