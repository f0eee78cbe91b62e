"""ParticipantService over grpc.aio: protobuf in, control-plane calls, protobuf out.

The handler adapters (parsing inside, typed refusals, the cancellation rule, the observer
around each call) and the wire conversions are `server.core.rpc`'s, shared with the
coordinator; this module is the mapping between the messages and the control plane.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from importlib import metadata

import grpc

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, invalid_request
from rollout_checkpoint.server.core.layout import SCHEMA_VERSION, StoredManifest
from rollout_checkpoint.server.core.rpc import handlers
from rollout_checkpoint.server.core.rpc.wire import deadline_of, duration, episode_ids, timestamp
from rollout_checkpoint.server.runtime.control_plane import (
    CommitResult,
    ControlPlane,
    LastPart,
    PrepareUpdate,
    RestoreResult,
    State,
    UpdateKind,
)
from rollout_checkpoint.server.runtime.part_writes import PartWrite, PartWriteState
from rollout_checkpoint.server.runtime.participant import (
    BlockerReason,
    EpisodeInfo,
    Kind,
    ReadinessReport,
)
from rollout_checkpoint.server.runtime.result_outbox import HeldResult, receipts_from
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["ParticipantService"]
SERVICE_NAME = SERVICE.full_name
API_VERSION = "rollout_checkpoint.v1"

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
        """Every RPC of participant_service.proto, served by the method of its name."""
        return handlers.service(SERVICE, self, self.control.observer)

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
            prepare_fence=True,
        )

    async def get_status(self, request: pb.GetStatusRequest) -> pb.GetStatusResponse:
        status = await self.control.status()
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
            response.lease_expires_at.CopyFrom(timestamp(status.lease_expires_at))
        if status.last_part is not None:
            response.last_part.CopyFrom(_published_part(status.last_part))
        return response

    async def list_episodes(self, request: pb.ListEpisodesRequest) -> pb.ListEpisodesResponse:
        episodes, token = await self.control.list_episodes(request.page_size, request.page_token)
        return pb.ListEpisodesResponse(
            episodes=[_episode(e) for e in episodes], next_page_token=token
        )

    async def prepare(self, request: pb.PrepareRequest) -> AsyncIterator[pb.PrepareResponse]:
        if request.expected_boot_id and request.expected_boot_id != self.boot_id:
            # The caller means the process this one replaced: preparing this one would
            # close it and commit an empty part in place of everything that one held.
            raise CheckpointError(
                Reason.BOOT_ID_MISMATCH,
                "this participant is another process than the one the caller means to "
                "prepare (it was replaced): learn its state again before checkpointing it",
                metadata={"bootId": self.boot_id, "expectedBootId": request.expected_boot_id},
            )
        deadline = deadline_of(request)
        updates = await self.control.prepare(request.checkpoint_id, deadline)
        async for update in updates:
            yield _prepare_response(update)

    async def renew(self, request: pb.RenewRequest) -> pb.RenewResponse:
        lease = await self.control.renew(request.checkpoint_id, deadline_of(request))
        return pb.RenewResponse(lease_expires_at=timestamp(lease))

    async def commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        deadline = deadline_of(request)
        scope = _scope(request.scope, "scope") if request.HasField("scope") else None
        result = await self.control.commit(
            request.checkpoint_id,
            deadline,
            request.checkpoint_dir,
            scope,
            asynchronous=request.asynchronous,
        )
        return _commit_response(result, self.control.participant.kind)

    async def await_part(self, request: pb.AwaitPartRequest) -> pb.AwaitPartResponse:
        deadline = deadline_of(request) if request.HasField("deadline") else None
        write = await self.control.await_part(request.checkpoint_id, deadline)
        return _await_part_response(write, self.control.participant.kind)

    async def restore(self, request: pb.RestoreRequest) -> pb.RestoreResponse:
        deadline = deadline_of(request)
        if not request.HasField("scope"):
            raise invalid_request("scope", "is required for a restore (it may be empty)")
        scope = _scope(request.scope, "scope")
        result = await self.control.restore(
            request.checkpoint_id,
            deadline,
            request.checkpoint_dir,
            scope,
            rejoin=request.rejoin,
        )
        return _restore_response(result)

    async def resume(self, request: pb.ResumeRequest) -> pb.ResumeResponse:
        idempotent = await self.control.resume(request.checkpoint_id, deadline_of(request))
        return pb.ResumeResponse(state=types_pb2.PARTICIPANT_STATE_IDLE, idempotent=idempotent)

    async def retire(self, request: pb.RetireRequest) -> pb.RetireResponse:
        deadline = deadline_of(request)
        episodes = episode_ids(request.episodes, "episodes")
        retired = await self.control.retire(request.checkpoint_id, deadline, episodes)
        return pb.RetireResponse(retired=retired)

    async def forget(self, request: pb.ForgetRequest) -> pb.ForgetResponse:
        forgotten = await self.control.forget(
            request.checkpoint_id, deadline_of(request), list(request.rollout_ids)
        )
        return pb.ForgetResponse(forgotten=forgotten)

    async def list_results(self, request: pb.ListResultsRequest) -> pb.ListResultsResponse:
        results, token, held, cap = await self.control.list_results(
            request.page_size, request.page_token
        )
        return pb.ListResultsResponse(
            results=[_held_result(h) for h in results], next_page_token=token, held=held, cap=cap
        )

    async def acknowledge_results(
        self, request: pb.AcknowledgeResultsRequest
    ) -> pb.AcknowledgeResultsResponse:
        deadline = deadline_of(request)
        receipts = receipts_from(
            (r.rollout_id, r.attempt, r.result_sha256) for r in request.receipts
        )
        done = await self.control.acknowledge_results(deadline, receipts)
        return pb.AcknowledgeResultsResponse(released=done.released, not_held=done.not_held)

    async def set_weight_version(
        self, request: pb.SetWeightVersionRequest
    ) -> pb.SetWeightVersionResponse:
        previous = await self.control.set_weight_version(
            deadline_of(request), request.weight_version
        )
        return pb.SetWeightVersionResponse(previous=previous)


# -- conversions ----------------------------------------------------------------------------


def _held_result(held: HeldResult) -> pb.HeldResult:
    receipt = held.receipt
    return pb.HeldResult(
        receipt=pb.ResultReceipt(
            rollout_id=receipt.rollout_id,
            attempt=receipt.attempt,
            result_sha256=receipt.result_sha256,
            lineage=list(receipt.lineage),
        ),
        capture_key=held.episode_id.capture_key,
        route=held.route,
        result_json=held.canonical.encode(),
        request_sha256=held.request_sha256,
    )


def _scope(scope: types_pb2.EpisodeScope, field: str) -> frozenset[EpisodeId]:
    return frozenset(episode_ids(scope.episodes, f"{field}.episodes"))


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
        oldest_weight_version=info.oldest_weight_version,
    )


def _prepare_response(update: PrepareUpdate) -> pb.PrepareResponse:
    response = pb.PrepareResponse(
        state=_STATES[update.state],
        checkpoint_id=update.checkpoint_id,
        readiness=_report(update.report),
        sequence=update.sequence,
        elapsed=duration(update.elapsed),
        update_kind=_UPDATE_KINDS[update.kind],
        final=update.final,
        replayed=update.replayed,
        admission_open=update.admission_open,
    )
    if update.lease_expires_at is not None:
        response.lease_expires_at.CopyFrom(timestamp(update.lease_expires_at))
    return response


def _manifest(manifest: StoredManifest, kind: Kind) -> types_pb2.Manifest:
    message = types_pb2.Manifest(
        schema_version=manifest.schema_version,
        kind=_KINDS[kind],
        instance=manifest.instance,
        checkpoint_id=manifest.checkpoint_id,
        records_file=manifest.records_file,
        records_sha256=manifest.records_sha256,
        record_count=manifest.record_count,
        bytes=manifest.bytes,
    )
    if manifest.chain is not None:  # a full part's reply stays as it always was
        message.own_records = manifest.own_records
        message.referenced_records = manifest.referenced_records
        message.chain_length = manifest.chain_length
    return message


def _published_part(part: LastPart) -> pb.PublishedPart:
    manifest = part.manifest
    records = manifest.records
    return pb.PublishedPart(
        checkpoint_id=manifest.checkpoint_id,
        checkpoint_dir=part.checkpoint_dir,
        asynchronous=part.asynchronous,
        record_count=manifest.record_count,
        records_written=records.written,
        records_referenced=records.referenced,
        chain_length=records.chain_length,
        bytes=manifest.bytes,
    )


def _commit_response(result: CommitResult, kind: Kind) -> pb.CommitResponse:
    response = pb.CommitResponse(
        state=types_pb2.PARTICIPANT_STATE_COMMITTED,
        manifest_sha256=result.manifest_sha256,
        exported=result.exported,
        retired=result.retired,
        snapshot_only=result.snapshot_only,
        snapshot_records=result.snapshot_records,
        snapshot_bytes=result.snapshot_bytes,
        records_written=result.records.written,
        records_referenced=result.records.referenced,
        chain_length=result.records.chain_length,
    )
    if result.manifest is not None:
        response.manifest.CopyFrom(_manifest(result.manifest, kind))
    return response


_PART_WRITE_STATES = {
    PartWriteState.UNKNOWN: pb.PART_WRITE_STATE_UNKNOWN,
    PartWriteState.WRITING: pb.PART_WRITE_STATE_WRITING,
    PartWriteState.DURABLE: pb.PART_WRITE_STATE_DURABLE,
    PartWriteState.FAILED: pb.PART_WRITE_STATE_FAILED,
}


def _await_part_response(write: PartWrite | None, kind: Kind) -> pb.AwaitPartResponse:
    if write is None:
        return pb.AwaitPartResponse(state=pb.PART_WRITE_STATE_UNKNOWN)
    response = pb.AwaitPartResponse(state=_PART_WRITE_STATES[write.state])
    if write.published is not None:
        response.manifest.CopyFrom(_manifest(write.published.manifest, kind))
        response.manifest_sha256 = write.published.manifest_sha256
    if write.error is not None:
        response.failure_reason = write.error.reason.value
        response.failure_message = write.error.message
    return response


def _restore_response(result: RestoreResult) -> pb.RestoreResponse:
    return pb.RestoreResponse(
        state=types_pb2.PARTICIPANT_STATE_RESTORED,
        source_checkpoint_id=result.source_checkpoint_id,
        restored=result.restored,
    )
