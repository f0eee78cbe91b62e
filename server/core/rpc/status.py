"""`CheckpointError` -> `google.rpc.Status` with one `ErrorInfo` (and its companions).

Controllers switch on `ErrorInfo.reason`; the companions carry what AIP-193 asks for a
reason: `BadRequest` naming the field, `PreconditionFailure` for a phase, `RetryInfo`.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout_checkpoint.server.core.errors import ERROR_DOMAIN, CheckpointError, Reason


def to_status_proto(error: CheckpointError) -> status_pb2.Status:
    details = [
        _pack(
            error_details_pb2.ErrorInfo(
                reason=error.reason.value, domain=ERROR_DOMAIN, metadata=error.metadata
            )
        )
    ]
    if error.field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=error.message
        )
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if error.reason is Reason.INVALID_PHASE:
        violation_pf = error_details_pb2.PreconditionFailure.Violation(
            type="STATE", subject=error.metadata.get("state", ""), description=error.message
        )
        details.append(_pack(error_details_pb2.PreconditionFailure(violations=[violation_pf])))
    if error.retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(
        code=code_pb2.Code.Value(error.code), message=error.message, details=details
    )


def to_grpc_status(error: CheckpointError) -> grpc.Status:
    return rpc_status.to_status(to_status_proto(error))


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed
