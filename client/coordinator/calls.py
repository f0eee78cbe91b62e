"""What CoordinatorService adds to the shared rpc plumbing: its refusals and its spans.

Auth, the status codec, the handler adapters, health and reflection are
`rollout_checkpoint.server.core.rpc`'s, the same as the participants'. Only this is the
coordinator's own: a fleet refusal's `ErrorInfo` metadata (`fleet_metadata`), a member's
refusal relayed with the member's own reason (`status_of`), the supervisor's failures as such
a refusal (`encodable`), and a SERVER span per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.rpc import status_pb2

from rollout_checkpoint.client.checkpointing.fanout import FleetError, FleetProgress, Outcome
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    StorageFailed,
    as_checkpoint_error,
    store_call,
)
from rollout_checkpoint.client.coordinator.fleet_events import WatcherTooSlow
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError
from rollout_checkpoint.client.recovery import RecoveryLostRace
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


T = TypeVar("T")


def no_checkpoint_root(consequence: str) -> CheckpointError:
    """The refusal of a call that needs the fleet file's checkpoint_root when it sets none."""
    return CheckpointError(
        Reason.INVALID_REQUEST,
        f"the fleet file sets no checkpoint_root{consequence}",
        code="FAILED_PRECONDITION",
    )


async def root_call(deadline: float, location: str, function: Callable[..., T], *args: Any) -> T:
    """`store_call` on the checkpoint root, its failures as the coordinator's typed errors
    (an OSError or a root that does not answer by `deadline`: STORAGE_FAILED)."""
    try:
        return await store_call(deadline, location, function, *args)
    except OSError as error:
        raise as_checkpoint_error(
            StorageFailed(f"{location}: {error.strerror or error}")
        ) from error
    except PublicationError as error:
        raise as_checkpoint_error(error) from error


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


def encodable(error: BaseException) -> BaseException:
    """A supervisor action's failure as `status_of` can encode it (a fleet refusal, or the
    coordinator's own)."""
    if isinstance(error, (FleetError, CheckpointError)):
        return error
    if isinstance(error, RecoveryLostRace):
        return error.error
    if isinstance(error, (DiscoveryError, TimeoutError)):
        return CheckpointError(Reason.PARTICIPANT_UNREACHABLE, str(error), code="UNAVAILABLE")
    if isinstance(error, PublicationError):
        return as_checkpoint_error(error)
    return CheckpointError(Reason.INVALID_CHECKPOINT_STATE, str(error), code="FAILED_PRECONDITION")


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
