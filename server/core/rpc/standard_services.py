"""grpc.health.v1.Health and server reflection, with the manners of the control services.

One implementation for the participant's sidecar and the coordinator.

grpcio's generated registrations deserialize a request before any handler runs: bytes that
do not parse are answered UNKNOWN with no details, and grpcio logs one ERROR traceback per
call. Health takes no token (the kubelet sends none), so anyone who can reach the port could
flood the log that way. Here both services are registered with an identity deserializer and
parse inside, as handlers.py does: bytes that do not parse are INVALID_ARGUMENT /
`INVALID_REQUEST` with a `google.rpc.Status`, and such hostile input is logged at most once
per interval. Health also answers `List`, which grpcio's aio servicer leaves to a
NotImplementedError (another traceback per call).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from grpc import aio
from grpc_health.v1 import health, health_pb2

from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.extras import REFLECTION, require
from rollout_checkpoint.server.core.rpc.handlers import parse, serialize
from rollout_checkpoint.server.core.rpc.status import to_grpc_status

if TYPE_CHECKING:
    from grpc_reflection.v1alpha import reflection_pb2

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
# grpc_reflection.v1alpha.reflection.SERVICE_NAME, spelled out: grpcio-reflection is an
# optional extra, imported only when reflection is configured (core/extras.py).
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
Req = TypeVar("Req", bound=Message)
Context = aio.ServicerContext[Any, Any]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _HealthListResponseClass(Protocol):
    """`grpc.health.v1.HealthListResponse`'s constructor (`map<string, HealthCheckResponse>
    statuses = 1`), spelled out because grpcio-health-checking's `health_pb2.pyi` predates
    `List`. Typing the class as `type[Message]` instead claimed `Message`'s constructor, which
    type-checked only while the protobuf stubs gave it `**kwargs: Any` (they no longer do)."""

    def __call__(
        self, *, statuses: Mapping[str, health_pb2.HealthCheckResponse] = ...
    ) -> Message: ...


_health_messages: Any = health_pb2  # the type stubs predate List
HEALTH_LIST_REQUEST: type[Message] = _health_messages.HealthListRequest
HEALTH_LIST_RESPONSE: _HealthListResponseClass = _health_messages.HealthListResponse


class RateLimitedLog:
    """At most one WARNING per `interval` seconds for events anyone can cause at will.

    The first event is logged at once; later ones within the interval are only counted, and
    the count rides on the next line logged after the interval. Unauthenticated callers
    (health and reflection take no token) can send hostile input as fast as the port
    accepts it; one line per call would let them flood the log and hide everything else."""

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


class ListingHealthServicer(health.aio.HealthServicer):
    """grpcio's aio health servicer, plus `List` (every registered name and its status)."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {"": SERVING}
        self._final = False

    async def set(self, service: str, status: int) -> None:
        await super().set(service, status)
        if not self._final:
            self._statuses[service] = status

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._final = True
        self._statuses = dict.fromkeys(self._statuses, NOT_SERVING)

    async def List(self, request: Message, context: Context) -> Message:
        """Every name registered here and its status (the controller's view of the pod)."""
        return HEALTH_LIST_RESPONSE(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._statuses.items()
            }
        )


def hostile_input_log() -> RateLimitedLog:
    """One per server: at most one line per minute however fast garbage arrives."""
    return RateLimitedLog(log)


def health_handler(
    servicer: ListingHealthServicer, hostile: RateLimitedLog
) -> grpc.GenericRpcHandler:
    """Check, Watch and List of `servicer`, each parsing its own request bytes."""
    refuse = _refuser(hostile)

    async def check(raw: bytes, context: Context) -> Message | None:
        try:
            request = parse(health_pb2.HealthCheckRequest, raw)
        except CheckpointError as error:
            await refuse(context, error)
            return None
        reply: Message = await servicer.Check(request, context)
        return reply

    async def watch(raw: bytes, context: Context) -> None:
        try:
            request = parse(health_pb2.HealthCheckRequest, raw)
        except CheckpointError as error:
            await refuse(context, error)
            return
        await servicer.Watch(request, context)

    async def listing(raw: bytes, context: Context) -> Message | None:
        try:
            request = parse(HEALTH_LIST_REQUEST, raw)
        except CheckpointError as error:
            await refuse(context, error)
            return None
        return await servicer.List(request, context)

    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Check": grpc.unary_unary_rpc_method_handler(check, None, serialize),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, None, serialize),
        "List": grpc.unary_unary_rpc_method_handler(listing, None, serialize),
    }
    return grpc.method_handlers_generic_handler(HEALTH_SERVICE, handlers)


def reflection_handler(
    service_names: Iterable[str], hostile: RateLimitedLog
) -> grpc.GenericRpcHandler:
    """Server reflection of `service_names`, parsing each request message itself.

    Raises `MissingExtra` (one line: install rollout-checkpoint[reflection]) when
    grpcio-reflection is not installed; call it while starting, before anything binds."""
    require(REFLECTION, "gRPC server reflection")
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    servicer = reflection.aio.ReflectionServicer(tuple(service_names))
    refuse = _refuser(hostile)

    async def info(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[Message]:
        async def parsed() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            async for raw in requests:
                yield parse(reflection_pb2.ServerReflectionRequest, raw)

        try:
            # The type stub says coroutine; it is an async generator.
            responses: AsyncIterator[Message] = servicer.ServerReflectionInfo(  # type: ignore[assignment]
                parsed(), context
            )
            async for response in responses:
                yield response
        except CheckpointError as error:
            await refuse(context, error)

    handler: grpc.RpcMethodHandler[Any, Any] = grpc.stream_stream_rpc_method_handler(
        info, None, serialize
    )
    return grpc.method_handlers_generic_handler(
        REFLECTION_SERVICE, {"ServerReflectionInfo": handler}
    )


def _refuser(hostile: RateLimitedLog) -> Callable[[Context, CheckpointError], Awaitable[None]]:
    async def refuse(context: Context, error: CheckpointError) -> None:
        hostile.warning(
            "refused request bytes that do not parse, from %s: %s", context.peer(), error.message
        )
        await context.abort_with_status(to_grpc_status(error))

    return refuse
