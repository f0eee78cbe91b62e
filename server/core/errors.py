"""Typed refusals, independent of any transport: the reasons of `errors.proto`, once.

The control plane, the participants and the coordinator raise `CheckpointError`; the rpc
layer turns it into a `google.rpc.Status` with one `ErrorInfo` (and the extra detail a reason
calls for). `errors.proto` is the source of truth: `Reason` names exactly its `ErrorReason`
values (without the `ERROR_REASON_` prefix) and `DEFAULT_CODES` gives each its status code;
importing this module fails when either differs from the generated `errors_pb2`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from rollout_checkpoint.v1 import errors_pb2

ERROR_DOMAIN = "rollout-checkpoint.dev"
REASON_PREFIX = "ERROR_REASON_"


class Reason(enum.StrEnum):
    """`ErrorInfo.reason` values (errors.proto `ErrorReason` without its prefix)."""

    STALE_CHECKPOINT = "STALE_CHECKPOINT"
    CHECKPOINT_CONFLICT = "CHECKPOINT_CONFLICT"
    INVALID_PHASE = "INVALID_PHASE"
    CHECKPOINT_DEADLINE_EXCEEDED = "CHECKPOINT_DEADLINE_EXCEEDED"
    RETIRE_INCOMPLETE = "RETIRE_INCOMPLETE"
    FRESH_PROCESS_REQUIRED = "FRESH_PROCESS_REQUIRED"
    SCOPE_REQUIRED = "SCOPE_REQUIRED"
    TASK_MISMATCH = "TASK_MISMATCH"
    INVALID_CHECKPOINT_STATE = "INVALID_CHECKPOINT_STATE"
    UNSERIALIZABLE_STATE = "UNSERIALIZABLE_STATE"
    HOOK_FAILED = "HOOK_FAILED"
    STORAGE_FAILED = "STORAGE_FAILED"
    INVALID_REQUEST = "INVALID_REQUEST"
    TOKEN_INVALID = "TOKEN_INVALID"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    PARTICIPANT_FAILED = "PARTICIPANT_FAILED"
    PARTICIPANT_UNREACHABLE = "PARTICIPANT_UNREACHABLE"
    INTERNAL_ERROR = "INTERNAL_ERROR"
    BOOT_ID_MISMATCH = "BOOT_ID_MISMATCH"
    RECEIPT_MISMATCH = "RECEIPT_MISMATCH"


DEFAULT_CODES: Mapping[Reason, str] = {
    Reason.STALE_CHECKPOINT: "ABORTED",
    Reason.CHECKPOINT_CONFLICT: "ABORTED",
    Reason.INVALID_PHASE: "FAILED_PRECONDITION",
    Reason.CHECKPOINT_DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    Reason.RETIRE_INCOMPLETE: "FAILED_PRECONDITION",
    Reason.FRESH_PROCESS_REQUIRED: "FAILED_PRECONDITION",
    Reason.SCOPE_REQUIRED: "INVALID_ARGUMENT",
    Reason.TASK_MISMATCH: "FAILED_PRECONDITION",
    Reason.INVALID_CHECKPOINT_STATE: "DATA_LOSS",
    Reason.UNSERIALIZABLE_STATE: "FAILED_PRECONDITION",
    Reason.HOOK_FAILED: "INTERNAL",
    Reason.STORAGE_FAILED: "UNAVAILABLE",
    Reason.INVALID_REQUEST: "INVALID_ARGUMENT",
    Reason.TOKEN_INVALID: "UNAUTHENTICATED",
    Reason.SHUTTING_DOWN: "UNAVAILABLE",
    Reason.PARTICIPANT_FAILED: "UNKNOWN",
    Reason.PARTICIPANT_UNREACHABLE: "UNAVAILABLE",
    Reason.INTERNAL_ERROR: "INTERNAL",
    Reason.BOOT_ID_MISMATCH: "FAILED_PRECONDITION",
    Reason.RECEIPT_MISMATCH: "FAILED_PRECONDITION",
}


def proto_reasons() -> frozenset[str]:
    """The reasons `errors.proto` defines (its `ErrorReason` values without the prefix)."""
    return frozenset(
        value.name.removeprefix(REASON_PREFIX)
        for value in errors_pb2.ErrorReason.DESCRIPTOR.values
        if value.number != 0
    )


def _check_against_proto() -> None:
    proto = proto_reasons()
    ours = frozenset(reason.value for reason in Reason)
    if ours != proto or set(DEFAULT_CODES) != set(Reason):
        raise ImportError(
            "rollout_checkpoint.server.core.errors is out of step with errors.proto: "
            f"only in errors.proto {sorted(proto - ours)}, only here {sorted(ours - proto)}, "
            f"without a default code {sorted(set(Reason) - set(DEFAULT_CODES))}"
        )


_check_against_proto()


class CheckpointError(Exception):
    """A refusal the controller can act on: a stable reason, a message, and metadata.

    `code` is a `google.rpc.Code` name; it defaults to the reason's usual code. `field` names
    the offending request field of an `INVALID_REQUEST`; `state` and `operation` fill the
    `PreconditionFailure` of an `INVALID_PHASE`; `retry_after` (seconds) adds a `RetryInfo`.

    A participant hook raises it to refuse with a reason of its own choosing (an invalid
    stored record: `rejected_checkpoint`); the controller receives exactly this reason, code,
    message and metadata as a `google.rpc.Status` with one `ErrorInfo` (domain
    `ERROR_DOMAIN`), and the control plane undoes the RPC as for any failed hook. Any other
    exception from a hook reaches the controller as `HOOK_FAILED`, without its message.
    Metadata keys are lowerCamelCase (`captureKey`, `checkpointId`) and values strings.
    """

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        code: str | None = None,
        metadata: Mapping[str, str] | None = None,
        field: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.code = code or DEFAULT_CODES[reason]
        self.metadata = dict(metadata or {})
        self.field = field
        self.retry_after = retry_after
        if field is not None:
            self.metadata.setdefault("field", field)

    def __repr__(self) -> str:
        return f"CheckpointError({self.reason}, {self.message!r})"


def invalid_request(field: str, message: str) -> CheckpointError:
    """`INVALID_REQUEST` (INVALID_ARGUMENT) naming the offending request `field` (it becomes
    the `field` metadata and a `BadRequest` field violation): the request is malformed and a
    retry of the same request fails the same way."""
    return CheckpointError(Reason.INVALID_REQUEST, f"{field}: {message}", field=field)


def invalid_phase(state: str, operation: str, message: str) -> CheckpointError:
    """`INVALID_PHASE` (FAILED_PRECONDITION): `operation` is not allowed in `state`; both go
    into the metadata (the state also into a `PreconditionFailure`), so a controller can tell
    which step of its sequence it got wrong (resume first, prepare first, ...)."""
    return CheckpointError(
        Reason.INVALID_PHASE, message, metadata={"state": state, "operation": operation}
    )


def deadline_exceeded(message: str, deadline: float) -> CheckpointError:
    """`CHECKPOINT_DEADLINE_EXCEEDED` with the request's `deadline` (Unix seconds, six
    decimals) as metadata: the participant, not the transport, decided that the deadline
    passed, so the outcome is known (nothing changed, or the work continues for a retry)."""
    return CheckpointError(
        Reason.CHECKPOINT_DEADLINE_EXCEEDED, message, metadata={"deadline": f"{deadline:.6f}"}
    )


def corrupt_checkpoint(message: str, path: str, capture_key: str | None = None) -> CheckpointError:
    """A part that is missing, torn or does not match its manifest (DATA_LOSS)."""
    metadata = {"path": path}
    if capture_key is not None:
        metadata["captureKey"] = capture_key
    return CheckpointError(Reason.INVALID_CHECKPOINT_STATE, message, metadata=metadata)


def rejected_checkpoint(
    message: str, path: str | None = None, capture_key: str | None = None
) -> CheckpointError:
    """A part that is intact but cannot be used here (FAILED_PRECONDITION)."""
    metadata = {}
    if path is not None:
        metadata["path"] = path
    if capture_key is not None:
        metadata["captureKey"] = capture_key
    return CheckpointError(
        Reason.INVALID_CHECKPOINT_STATE, message, code="FAILED_PRECONDITION", metadata=metadata
    )
