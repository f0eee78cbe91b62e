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
        return self.reason is not None

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError) -> ControlError:
        code, message = error.code(), error.details() or ""
        status = status_of_rpc_error(error)
        info = None if status is None else error_info(status)
        if status is None or info is None:
            return cls(code, message)
        return cls(code, status.message, info.reason, info.domain, dict(info.metadata))
