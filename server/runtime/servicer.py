"""ParticipantService over grpc.aio: protobuf in, control-plane calls, protobuf out.

Handlers are registered with an identity request deserializer and parse the bytes themselves:
grpcio would otherwise answer a request that does not parse with UNKNOWN and no details, and
controllers must always get `INVALID_REQUEST` they can switch on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import metadata
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf.message import DecodeError, Message
from grpc import aio

from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId, rollout_id_problem
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, invalid_request
from rollout_checkpoint.server.core.part_storage import SCHEMA_VERSION, StoredManifest
from rollout_checkpoint.server.core.rpc.status import to_grpc_status
from rollout_checkpoint.server.runtime.control_plane import (
    CommitResult,
    ControlPlane,
    PrepareUpdate,
    RestoreResult,
    State,
    UpdateKind,
)
from rollout_checkpoint.server.runtime.observe import ControlObserver
from rollout_checkpoint.server.runtime.participant import (
    BlockerReason,
    EpisodeInfo,
    Kind,
    ReadinessReport,
)
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "rollout_checkpoint.v1.ParticipantService"
API_VERSION = "rollout_checkpoint.v1"
MAX_TIMESTAMP_SECONDS = 253402300799  # 9999-12-31T23:59:59Z, the Timestamp range

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
Context = aio.ServicerContext[bytes, Any]

_STATES = {
    State.IDLE: types_pb2.PARTICIPANT_STATE_IDLE,
    State.PREPARING: types_pb2.PARTICIPANT_STATE_PREPARING,
    State.PREPARED: types_pb2.PARTICIPANT_STATE_PREPARED,
    State.COMMITTED: types_pb2.PARTICIPANT_STATE_COMMITTED,
    State.RESTORED: types_pb2.PARTICIPANT_STATE_RESTORED,
}
_KINDS = {
    Kind.ENVIRONMENT: types_pb2.PARTICIPANT_KIND_ENVIRONMENT,
    Kind.MODEL: types_pb2.PARTICIPANT_KIND_MODEL,
    Kind.AGENT: types_pb2.PARTICIPANT_KIND_AGENT,
    Kind.RESOURCES: types_pb2.PARTICIPANT_KIND_RESOURCES,
}
_UPDATE_KINDS = {
    UpdateKind.INITIAL: pb.PREPARE_UPDATE_KIND_INITIAL,
    UpdateKind.CHANGE: pb.PREPARE_UPDATE_KIND_CHANGE,
    UpdateKind.HEARTBEAT: pb.PREPARE_UPDATE_KIND_HEARTBEAT,
    UpdateKind.FINAL: pb.PREPARE_UPDATE_KIND_FINAL,
}


def runtime_version() -> str:
    try:
        return metadata.version("rollout-checkpoint")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


class ParticipantServicer:
    """Serves one ControlPlane. `boot_id` is new per process, so a controller sees restarts."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control
        self.boot_id = uuid.uuid4().hex

    def generic_handler(self) -> grpc.GenericRpcHandler:
        unary: dict[str, tuple[type[Message], Callable[[Any], Awaitable[Message]]]] = {
            "GetParticipant": (pb.GetParticipantRequest, self.get_participant),
            "GetStatus": (pb.GetStatusRequest, self.get_status),
            "ListEpisodes": (pb.ListEpisodesRequest, self.list_episodes),
            "Renew": (pb.RenewRequest, self.renew),
            "Commit": (pb.CommitRequest, self.commit),
            "Restore": (pb.RestoreRequest, self.restore),
            "Resume": (pb.ResumeRequest, self.resume),
            "Retire": (pb.RetireRequest, self.retire),
            "Forget": (pb.ForgetRequest, self.forget),
        }
        observer = self.control.observer
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            name: grpc.unary_unary_rpc_method_handler(
                _unary(name, request_type, method, observer), None, _serialize
            )
            for name, (request_type, method) in unary.items()
        }
        handlers["Prepare"] = grpc.unary_stream_rpc_method_handler(
            _server_stream("Prepare", pb.PrepareRequest, self.prepare, observer), None, _serialize
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    # -- RPCs ---------------------------------------------------------------------------

    async def get_participant(self, request: pb.GetParticipantRequest) -> pb.GetParticipantResponse:
        participant = self.control.participant
        return pb.GetParticipantResponse(
            kind=_KINDS[participant.kind],
            instance=participant.instance,
            boot_id=self.boot_id,
            api_version=API_VERSION,
            schema_version=SCHEMA_VERSION,
            runtime_version=runtime_version(),
            facts=dict(participant.facts()),
        )

    async def get_status(self, request: pb.GetStatusRequest) -> pb.GetStatusResponse:
        status = self.control.status()
        response = pb.GetStatusResponse(
            state=_STATES[status.state],
            checkpoint_id=status.checkpoint_id,
            admission_open=status.admission_open,
            readiness=_report(status.report),
            retired_rollouts=status.retired_rollouts,
            restored_pending=status.restored_pending,
            facts=status.facts,
            counters=status.counters,
            boot_id=self.boot_id,
        )
        if status.lease_expires_at is not None:
            response.lease_expires_at.CopyFrom(_timestamp(status.lease_expires_at))
        return response

    async def list_episodes(self, request: pb.ListEpisodesRequest) -> pb.ListEpisodesResponse:
        episodes, token = self.control.list_episodes(request.page_size, request.page_token)
        return pb.ListEpisodesResponse(
            episodes=[_episode(e) for e in episodes], next_page_token=token
        )

    async def prepare(self, request: pb.PrepareRequest) -> AsyncIterator[pb.PrepareResponse]:
        deadline = _deadline(request)
        updates = await self.control.prepare(request.checkpoint_id, deadline)
        async for update in updates:
            yield _prepare_response(update)

    async def renew(self, request: pb.RenewRequest) -> pb.RenewResponse:
        lease = await self.control.renew(request.checkpoint_id, _deadline(request))
        return pb.RenewResponse(lease_expires_at=_timestamp(lease))

    async def commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        deadline = _deadline(request)
        scope = _scope(request.scope, "scope") if request.HasField("scope") else None
        result = await self.control.commit(
            request.checkpoint_id, deadline, request.checkpoint_dir, scope
        )
        return _commit_response(result, self.control.participant.kind)

    async def restore(self, request: pb.RestoreRequest) -> pb.RestoreResponse:
        deadline = _deadline(request)
        if not request.HasField("scope"):
            raise invalid_request("scope", "is required for a restore (it may be empty)")
        scope = _scope(request.scope, "scope")
        result = await self.control.restore(
            request.checkpoint_id, deadline, request.checkpoint_dir, scope
        )
        return _restore_response(result)

    async def resume(self, request: pb.ResumeRequest) -> pb.ResumeResponse:
        idempotent = await self.control.resume(request.checkpoint_id, _deadline(request))
        return pb.ResumeResponse(state=types_pb2.PARTICIPANT_STATE_IDLE, idempotent=idempotent)

    async def retire(self, request: pb.RetireRequest) -> pb.RetireResponse:
        deadline = _deadline(request)
        episodes = [_episode_id(e, f"episodes[{i}]") for i, e in enumerate(request.episodes)]
        retired = await self.control.retire(request.checkpoint_id, deadline, episodes)
        return pb.RetireResponse(retired=retired)

    async def forget(self, request: pb.ForgetRequest) -> pb.ForgetResponse:
        forgotten = await self.control.forget(
            request.checkpoint_id, _deadline(request), list(request.rollout_ids)
        )
        return pb.ForgetResponse(forgotten=forgotten)


# -- handler plumbing -----------------------------------------------------------------------


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _parse(request_type: type[Req], raw: bytes) -> Req:
    try:
        return request_type.FromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            Reason.INVALID_REQUEST,
            f"the request bytes do not parse as {request_type.DESCRIPTOR.full_name}",
            field="request",
        ) from exc


async def _abort(context: Context, error: CheckpointError) -> None:
    await context.abort_with_status(to_grpc_status(error))


def _internal(exc: BaseException) -> CheckpointError:
    log.exception("unexpected failure in a control RPC", exc_info=exc)
    return CheckpointError(Reason.INTERNAL_ERROR, f"internal error ({type(exc).__name__})")


def _unary(
    name: str,
    request_type: type[Req],
    method: Callable[[Req], Awaitable[Message]],
    observer: ControlObserver,
) -> Callable[[bytes, Context], Awaitable[Message | None]]:
    async def handle(raw: bytes, context: Context) -> Message | None:
        # The observer times the call, carries the checkpoint id into logs and parents the
        # call's span to the caller's `traceparent`.
        with observer.operation(name, context.invocation_metadata()) as operation:
            try:
                request = _parse(request_type, raw)
                operation.checkpoint(getattr(request, "checkpoint_id", ""))
                return await method(request)
            except CheckpointError as error:
                operation.refused(error.reason.value)
                await _abort(context, error)
            except (aio.AbortError, aio.UsageError):
                raise
            except asyncio.CancelledError as exc:
                if _call_cancelled():
                    raise
                operation.refused(Reason.INTERNAL_ERROR.value)
                await _abort(context, _internal(exc))
            except Exception as exc:
                operation.refused(Reason.INTERNAL_ERROR.value)
                await _abort(context, _internal(exc))
        return None

    return handle


def _server_stream(
    name: str,
    request_type: type[Req],
    method: Callable[[Req], AsyncIterator[Message]],
    observer: ControlObserver,
) -> Callable[[bytes, Context], AsyncIterator[Message]]:
    async def handle(raw: bytes, context: Context) -> AsyncIterator[Message]:
        with observer.operation(name, context.invocation_metadata()) as operation:
            try:
                request = _parse(request_type, raw)
                operation.checkpoint(getattr(request, "checkpoint_id", ""))
                async for message in method(request):
                    yield message
            except CheckpointError as error:
                operation.refused(error.reason.value)
                await _abort(context, error)
            except (aio.AbortError, aio.UsageError):
                raise
            except asyncio.CancelledError as exc:
                if _call_cancelled():
                    raise
                operation.refused(Reason.INTERNAL_ERROR.value)
                await _abort(context, _internal(exc))
            except Exception as exc:
                operation.refused(Reason.INTERNAL_ERROR.value)
                await _abort(context, _internal(exc))

    return handle


def _call_cancelled() -> bool:
    """Whether the handler itself is being cancelled (the client went away, the server
    stops), as opposed to a CancelledError escaping from work it awaited. Only the first
    may end a handler without a status: grpc.aio sends nothing for an escaped
    CancelledError, and a client without its own timeout would hang."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# -- conversions ----------------------------------------------------------------------------


def _deadline(request: Any) -> float:
    if not request.HasField("deadline"):
        raise invalid_request("deadline", "is required (an absolute google.protobuf.Timestamp)")
    stamp: timestamp_pb2.Timestamp = request.deadline
    if not 0 <= stamp.nanos < 1_000_000_000 or not 0 < stamp.seconds <= MAX_TIMESTAMP_SECONDS:
        raise invalid_request("deadline", "is not a valid timestamp")
    return stamp.seconds + stamp.nanos / 1e9


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration


def _episode_id(message: types_pb2.EpisodeId, field: str) -> EpisodeId:
    problem = rollout_id_problem(message.rollout_id)
    if problem is not None:
        raise invalid_request(f"{field}.rollout_id", problem)
    if message.attempt > MAX_ATTEMPT:
        raise invalid_request(f"{field}.attempt", f"must be at most {MAX_ATTEMPT}")
    return EpisodeId(message.rollout_id, message.attempt)


def _scope(scope: types_pb2.EpisodeScope, field: str) -> frozenset[EpisodeId]:
    return frozenset(_episode_id(e, f"{field}.episodes[{i}]") for i, e in enumerate(scope.episodes))


def _report(report: ReadinessReport) -> types_pb2.ReadinessReport:
    return types_pb2.ReadinessReport(
        ready=report.ready,
        blockers=[
            types_pb2.Blocker(
                capture_key=b.capture_key,
                reason=types_pb2.BlockerReason.Value(
                    f"BLOCKER_REASON_{BlockerReason(b.reason).value}"
                ),
                detail=b.detail,
            )
            for b in report.blockers
        ],
        blocker_count=report.blocker_count,
        counts=dict(report.counts),
    )


def _episode(info: EpisodeInfo) -> types_pb2.Episode:
    return types_pb2.Episode(
        episode_id=types_pb2.EpisodeId(
            rollout_id=info.episode_id.rollout_id, attempt=info.episode_id.attempt
        ),
        capture_key=info.episode_id.capture_key,
        at_boundary=info.at_boundary,
        restored_pending=info.restored_pending,
    )


def _prepare_response(update: PrepareUpdate) -> pb.PrepareResponse:
    response = pb.PrepareResponse(
        state=_STATES[update.state],
        checkpoint_id=update.checkpoint_id,
        readiness=_report(update.report),
        sequence=update.sequence,
        elapsed=_duration(update.elapsed),
        update_kind=_UPDATE_KINDS[update.kind],
        final=update.final,
        replayed=update.replayed,
        admission_open=update.admission_open,
    )
    if update.lease_expires_at is not None:
        response.lease_expires_at.CopyFrom(_timestamp(update.lease_expires_at))
    return response


def _manifest(manifest: StoredManifest, kind: Kind) -> types_pb2.Manifest:
    return types_pb2.Manifest(
        schema_version=manifest.schema_version,
        kind=_KINDS[kind],
        instance=manifest.instance,
        checkpoint_id=manifest.checkpoint_id,
        records_file=manifest.records_file,
        records_sha256=manifest.records_sha256,
        record_count=manifest.record_count,
        bytes=manifest.bytes,
    )


def _commit_response(result: CommitResult, kind: Kind) -> pb.CommitResponse:
    return pb.CommitResponse(
        state=types_pb2.PARTICIPANT_STATE_COMMITTED,
        manifest=_manifest(result.manifest, kind),
        manifest_sha256=result.manifest_sha256,
        exported=result.exported,
        retired=result.retired,
    )


def _restore_response(result: RestoreResult) -> pb.RestoreResponse:
    return pb.RestoreResponse(
        state=types_pb2.PARTICIPANT_STATE_RESTORED,
        source_checkpoint_id=result.source_checkpoint_id,
        restored=result.restored,
    )
