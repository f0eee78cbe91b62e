"""Errors a controller sees: the participant's `ErrorInfo` reason, or a transport failure."""

from __future__ import annotations

import grpc

from rollout_checkpoint.server.core.rpc.status import error_info, status_of_rpc_error


class ControlError(Exception):
    """A failed control RPC.

    `reason` is the `ErrorInfo.reason` the server decided on (switch on it); it is None when
    the status carried no details, which means the library or the network produced it (a
    client timeout, a dropped connection): the outcome on the server is then unknown.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str | None = None,
        domain: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {reason + ': ' if reason else ''}{message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata = metadata or {}

    @property
    def decided_by_server(self) -> bool:
        """Whether the participant decided this outcome (a reason is set), so the outcome is
        known: switch on `reason`. False: the library or the network failed the call and the
        outcome on the participant is unknown (retry the same call)."""
        return self.reason is not None

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError) -> ControlError:
        """The ControlError of a failed call: the reason, domain and metadata of the status's
        `ErrorInfo` when the server sent one, else the bare code and details (no reason)."""
        code, message = error.code(), error.details() or ""
        status = status_of_rpc_error(error)
        info = None if status is None else error_info(status)
        if status is None or info is None:
            return cls(code, message)
        return cls(code, status.message, info.reason, info.domain, dict(info.metadata))
