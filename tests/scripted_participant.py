"""A scripted ParticipantService for pytest-grpc's synchronous `grpc_server`.

The controllers (the coordination library, the CoordinatorService, `collect`) were written
against this project's participants, which always answer in time, in this version's schema and
with well-formed bytes. Participants in a real fleet are written by others and run other
versions: this one answers whatever a test scripts, including what no participant of this
project would send (a stream that never ends, enum values and fields from a newer schema, a
boot id that changes, a reply after its deadline, bytes that are no message at all), so a test
can check that the controller still ends every call typed and leaves the fleet open.

It is served by `grpc.server` in threads (pytest-grpc builds only synchronous servers), as a
generic handler whose response serializer passes raw bytes through: that is how a reply can be
garbage. Unscripted methods behave like a minimal, well-behaved participant with no episodes
(its Commit writes a real, empty part, so a checkpoint it joins can be published).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message
from grpc_status import rpc_status

from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence
from rollout_checkpoint.server.core.rpc.status import status_proto
from rollout_checkpoint.server.core.rpc.wire import timestamp
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

SERVICE = pb.DESCRIPTOR.services_by_name["ParticipantService"]

GARBAGE = b"\xff\xff\xff\xff not a protobuf message"
"""Bytes that parse as no message (a truncated varint tag): what a broken proxy might relay."""

UNKNOWN_STATE = 42
"""A ParticipantState a newer participant might send: proto3 enums are open, so it arrives as
the bare number."""

UNKNOWN_BLOCKER_REASON = 77
UNKNOWN_KIND = 9

Reply = Message | bytes
"""A handler returns a message, or raw bytes sent as they are."""

Unary = Callable[[Any, grpc.ServicerContext], Reply]
Streaming = Callable[[Any, grpc.ServicerContext], Iterable[Reply]]

KIND_DIRECTORIES = {
    types_pb2.PARTICIPANT_KIND_ENVIRONMENT: "environment",
    types_pb2.PARTICIPANT_KIND_MODEL: "model",
    types_pb2.PARTICIPANT_KIND_AGENT: "agent",
    types_pb2.PARTICIPANT_KIND_RESOURCES: "resources",
}


def with_unknown_fields(message: Message) -> bytes:
    """`message` serialized with two fields appended that this schema does not have (a varint
    and a nested message), as a participant built from a newer .proto would send them."""
    unknown_varint = _varint(1000 << 3 | 0) + _varint(123456)
    nested = b"\x0a\x03new"  # field 1, a string, inside
    unknown_message = _varint(1001 << 3 | 2) + _varint(len(nested)) + nested
    return message.SerializeToString() + unknown_varint + unknown_message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def refuse(
    context: grpc.ServicerContext,
    code: str,
    reason: str,
    message: str,
    metadata: dict[str, str] | None = None,
) -> NoReturn:
    """End the call the way a participant refuses: a `google.rpc.Status` with one ErrorInfo."""
    status = status_proto(code, reason, message, metadata or {})
    context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("abort_with_status returns only by raising")


class ScriptedParticipant:
    """A ParticipantService whose every method a test may replace (`script`).

    `calls` records every request by method name. `released` ends every held call (`hold`):
    it is set after each test, so no worker thread of the module's server stays blocked.
    """

    def __init__(self) -> None:
        self.kind: types_pb2.ParticipantKind.ValueType = types_pb2.PARTICIPANT_KIND_RESOURCES
        self.instance = "scripted"
        self.boot_id = "boot-1"
        self.script: dict[str, Unary | Streaming] = {}
        self.calls: list[tuple[str, Any]] = []
        self.released = threading.Event()
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Back to the well-behaved defaults (the server is shared by a test module)."""
        self.released.set()
        self.kind = types_pb2.PARTICIPANT_KIND_RESOURCES
        self.instance = "scripted"
        self.boot_id = "boot-1"
        self.script = {}
        with self._lock:
            self.calls = []
        self.released = threading.Event()

    def requests(self, method: str) -> list[Any]:
        with self._lock:
            return [request for name, request in self.calls if name == method]

    def hold(self, context: grpc.ServicerContext, seconds: float) -> bool:
        """Wait `seconds`, or less if the test ends or the caller goes away; True if the
        whole wait passed."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            if self.released.wait(0.05) or not context.is_active():
                return False
        return True

    # -- serving ------------------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every method of participant_service.proto, each dispatched to `script` or the
        default below at call time."""
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for method in SERVICE.methods:
            request_type = getattr(pb, method.input_type.name)
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    self._streaming(method.name),
                    request_deserializer=request_type.FromString,
                    response_serializer=_serialize,
                )
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(method.name),
                    request_deserializer=request_type.FromString,
                    response_serializer=_serialize,
                )
        return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

    def _record(self, method: str, request: Any) -> Any:
        with self._lock:
            self.calls.append((method, request))
        return self.script.get(method) or getattr(self, method)

    def _unary(self, method: str) -> Unary:
        def handle(request: Any, context: grpc.ServicerContext) -> Reply:
            behaviour: Unary = self._record(method, request)
            return behaviour(request, context)

        return handle

    def _streaming(self, method: str) -> Streaming:
        def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Reply]:
            behaviour: Streaming = self._record(method, request)
            yield from behaviour(request, context)

        return handle

    # -- a well-behaved participant with no episodes --------------------------------------

    def GetParticipant(
        self, request: pb.GetParticipantRequest, context: grpc.ServicerContext
    ) -> Reply:
        return pb.GetParticipantResponse(
            kind=self.kind,
            instance=self.instance,
            boot_id=self.boot_id,
            api_version="rollout_checkpoint.v1",
            schema_version=1,
        )

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> Reply:
        return pb.GetStatusResponse(
            state=types_pb2.PARTICIPANT_STATE_IDLE,
            admission_open=True,
            readiness=types_pb2.ReadinessReport(ready=True),
            boot_id=self.boot_id,
        )

    def ListEpisodes(self, request: pb.ListEpisodesRequest, context: grpc.ServicerContext) -> Reply:
        return pb.ListEpisodesResponse()

    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> Iterator[Reply]:
        yield prepared(request.checkpoint_id, sequence=1)

    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> Reply:
        return pb.RenewResponse(lease_expires_at=request.deadline)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> Reply:
        return self.write_empty_part(request)

    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> Reply:
        refuse(context, "FAILED_PRECONDITION", "FRESH_PROCESS_REQUIRED", "scripted: not fresh")

    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> Reply:
        return pb.ResumeResponse(state=types_pb2.PARTICIPANT_STATE_IDLE)

    def Retire(self, request: pb.RetireRequest, context: grpc.ServicerContext) -> Reply:
        return pb.RetireResponse()

    def Forget(self, request: pb.ForgetRequest, context: grpc.ServicerContext) -> Reply:
        return pb.ForgetResponse()

    def write_empty_part(self, request: pb.CommitRequest) -> pb.CommitResponse:
        """Commit the way a participant with no episodes does: a real, empty part on disk."""
        kind = KIND_DIRECTORIES[self.kind]
        part = LocalStorage().write_part(
            request.checkpoint_dir, kind, self.instance, request.checkpoint_id, [], WriteFence()
        )
        stored = part.manifest
        return pb.CommitResponse(
            state=types_pb2.PARTICIPANT_STATE_COMMITTED,
            manifest=types_pb2.Manifest(
                schema_version=stored.schema_version,
                kind=self.kind,
                instance=stored.instance,
                checkpoint_id=stored.checkpoint_id,
                records_file=stored.records_file,
                records_sha256=stored.records_sha256,
                record_count=stored.record_count,
                bytes=stored.bytes,
            ),
            manifest_sha256=part.manifest_sha256,
        )


def prepare_update(
    checkpoint_id: str,
    *,
    sequence: int,
    state: int = types_pb2.PARTICIPANT_STATE_PREPARING,
    kind: int = pb.PREPARE_UPDATE_KIND_HEARTBEAT,
    final: bool = False,
    blockers: Iterable[types_pb2.Blocker] = (),
) -> pb.PrepareResponse:
    """One message of a Prepare stream (the state and update kind may be numbers a newer
    schema defines)."""
    listed = list(blockers)
    return pb.PrepareResponse(
        state=state,  # type: ignore[arg-type]  # an open enum: any number may arrive
        checkpoint_id=checkpoint_id,
        readiness=types_pb2.ReadinessReport(
            ready=not listed, blockers=listed, blocker_count=len(listed)
        ),
        lease_expires_at=timestamp(time.time() + 60),
        sequence=sequence,
        update_kind=kind,  # type: ignore[arg-type]
        final=final,
    )


def prepared(checkpoint_id: str, *, sequence: int) -> pb.PrepareResponse:
    """The final message of a Prepare that reached PREPARED."""
    return prepare_update(
        checkpoint_id,
        sequence=sequence,
        state=types_pb2.PARTICIPANT_STATE_PREPARED,
        kind=pb.PREPARE_UPDATE_KIND_FINAL,
        final=True,
    )


def _serialize(reply: Reply) -> bytes:
    return reply if isinstance(reply, bytes) else reply.SerializeToString()
