"""`google.rpc.Status` with one `ErrorInfo` (and its companions), both ways.

Servers: `to_status_proto(CheckpointError)` for their own refusals and `status_proto` for a
refusal relayed as-is (the coordinator passing on a member's reason). Controllers switch on
`ErrorInfo.reason`; the companions carry what AIP-193 asks for a reason: `BadRequest` naming
the field, `PreconditionFailure` for a phase, `RetryInfo`.

Clients: `error_info(status)` and `status_of_rpc_error(error)` decode what a server sent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout_checkpoint.server.core.errors import ERROR_DOMAIN, CheckpointError, Reason

STATUS_DETAILS_KEY = "grpc-status-details-bin"
METADATA_KEY = re.compile(r"[a-z][a-zA-Z0-9\-_]+")
MAX_METADATA_KEY_LENGTH = 64


def is_metadata_key(key: str) -> bool:
    """Whether `key` may be an `ErrorInfo.metadata` key: google.rpc's rule
    `[a-z][a-zA-Z0-9-_]+`, at most 64 characters (errors.proto promises lowerCamelCase)."""
    return len(key) <= MAX_METADATA_KEY_LENGTH and METADATA_KEY.fullmatch(key) is not None


def status_proto(
    code: str,
    reason: str,
    message: str,
    metadata: Mapping[str, str],
    *,
    field: str | None = None,
    precondition_state: str | None = None,
    retry_after: float | None = None,
) -> status_pb2.Status:
    """A `google.rpc.Status` of `code` (a `google.rpc.Code` name) with one ErrorInfo of
    `reason`, plus a BadRequest naming `field`, a PreconditionFailure of type STATE for
    `precondition_state` and a RetryInfo of `retry_after` seconds, each when given."""
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))
    ]
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if precondition_state is not None:
        violation_pf = error_details_pb2.PreconditionFailure.Violation(
            type="STATE", subject=precondition_state, description=message
        )
        details.append(_pack(error_details_pb2.PreconditionFailure(violations=[violation_pf])))
    if retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry_after * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(code=code_pb2.Code.Value(code), message=message, details=details)


def to_status_proto(error: CheckpointError) -> status_pb2.Status:
    """The status a controller receives for `error`."""
    return status_proto(
        error.code,
        error.reason.value,
        error.message,
        error.metadata,
        field=error.field,
        precondition_state=(
            error.metadata.get("state", "") if error.reason is Reason.INVALID_PHASE else None
        ),
        retry_after=error.retry_after,
    )


def to_grpc_status(error: CheckpointError) -> grpc.Status:
    return rpc_status.to_status(to_status_proto(error))


def error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo | None:
    """The status's ErrorInfo; None when it has none (the library or the network spoke) or
    its bytes do not parse."""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        try:
            if detail.Unpack(info):
                return info
        except DecodeError:
            return None  # an ErrorInfo that does not parse says no reason a caller could trust
    return None


def status_of_rpc_error(error: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    """The `google.rpc.Status` a server sent in the `grpc-status-details-bin` trailer."""
    for key, value in error.trailing_metadata() or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            return status_pb2.Status.FromString(value)
        except DecodeError:
            return None
    return None


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed
