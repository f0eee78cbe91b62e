"""What CoordinatorService adds to the shared rpc plumbing: its refusals and its spans.

Auth, the status codec, the handler adapters, health and reflection are
`rollout_checkpoint.server.core.rpc`'s, the same as the participants'. Only this is the
coordinator's own: a fleet refusal's `ErrorInfo` metadata (`fleet_metadata`), a member's
refusal relayed with the member's own reason (`status_of`), and a SERVER span per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
from google.rpc import status_pb2

from rollout_checkpoint.client.checkpointing.fanout import FleetError, FleetProgress, Outcome
from rollout_checkpoint.client.coordinator.fleet_events import WatcherTooSlow
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.rpc.handlers import Metadata, checkpoint_status
from rollout_checkpoint.server.core.rpc.status import is_metadata_key, status_proto
from rollout_checkpoint.server.core.rpc.tracing import server_span
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

MAX_LISTED_BLOCKERS = 100
"""Blockers a FleetProgress or a supervisor event lists (their count is sent besides)."""

PREPARE_OUTCOMES = {
    Outcome.PREPARED: cpb.FLEET_PREPARE_OUTCOME_PREPARED,
    Outcome.NOT_PREPARED: cpb.FLEET_PREPARE_OUTCOME_NOT_PREPARED,
    Outcome.ENDED: cpb.FLEET_PREPARE_OUTCOME_ENDED,
}


def prepare_outcome(outcome: str | None) -> cpb.FleetPrepareOutcome.ValueType:
    """A fleet prepare's outcome on the wire (UNSPECIFIED while it is not final)."""
    return PREPARE_OUTCOMES.get(outcome or "", cpb.FLEET_PREPARE_OUTCOME_UNSPECIFIED)


def listed_blockers(progress: FleetProgress) -> list[cpb.MemberBlocker]:
    """The first `MAX_LISTED_BLOCKERS` blockers of a fleet prepare, each with its member."""
    return [
        cpb.MemberBlocker(member=name, blocker=blocker)
        for name, blocker in progress.blockers()[:MAX_LISTED_BLOCKERS]
    ]


SERVICE = cpb.DESCRIPTOR.services_by_name["CoordinatorService"]
SERVICE_NAME = SERVICE.full_name
TRACER_NAME = "rollout_checkpoint.client"
_tracer_provider: Any = None


def set_tracer_provider(provider: Any) -> None:
    """Use `provider` for the coordinator's spans (default: OpenTelemetry's global one)."""
    global _tracer_provider
    _tracer_provider = provider


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


def status_of(error: BaseException) -> status_pb2.Status:
    """The `google.rpc.Status` (with one ErrorInfo) a controller receives for `error`."""
    if isinstance(error, CheckpointError):
        return checkpoint_status(error)
    if isinstance(error, FleetError):
        return status_proto(error.code.name, error.reason, str(error), fleet_metadata(error))
    if isinstance(error, WatcherTooSlow):  # documented without a reason: reconnect
        return status_pb2.Status(
            code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=str(error)
        )
    if isinstance(error, ControlError):
        reason = error.reason or Reason.PARTICIPANT_UNREACHABLE.value
        metadata = {k: v for k, v in error.metadata.items() if is_metadata_key(k)}
        return status_proto(error.code.name, reason, error.message, metadata)
    return checkpoint_status(error)  # logged, INTERNAL_ERROR


class _SpanCall:
    def __init__(self, span: Any) -> None:
        self._span = span

    def checkpoint(self, checkpoint_id: str) -> None:
        if self._span is not None and checkpoint_id:
            self._span.set_attribute("rollout_checkpoint.checkpoint_id", checkpoint_id)

    def refused(self, reason: str) -> None:
        """The status says it; the span needs nothing more."""


class TracingObserver:
    """One SERVER span per coordinator call, parented to the caller's `traceparent`: the
    participant calls made inside carry it on, so one fleet checkpoint is one trace."""

    @contextlib.contextmanager
    def operation(self, method: str, metadata: Metadata = None) -> Iterator[_SpanCall]:
        with server_span(
            TRACER_NAME,
            f"{SERVICE_NAME}/{method}",
            metadata,
            tracer_provider=_tracer_provider,
        ) as span:
            yield _SpanCall(span)
