"""The `checkpoint` configuration block, from code, files or `ROLLOUT_CHECKPOINT_*` variables."""

from __future__ import annotations

import re
from typing import Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.object_store import is_object_url, parse_object_url
from rollout_checkpoint.server.runtime.control_plane import ControlSettings
from rollout_checkpoint.server.runtime.part_chain import (
    DEFAULT_FULL_EVERY,
    DEFAULT_MAX_STALE_SHARE,
    MAX_FULL_EVERY,
)
from rollout_checkpoint.server.runtime.result_outbox import DEFAULT_OUTBOX_CAP

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}$")


class CheckpointSettings(BaseSettings):
    """Checkpointing is off unless `enabled`; then a token is required and nothing else is.

    Unknown fields are rejected, so a misspelt option fails at startup instead of being
    silently ignored.
    """

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_CHECKPOINT_", extra="forbid", frozen=True)

    enabled: bool = False
    """Off by default: then nothing at all is installed and no other field is checked."""
    token: SecretStr = SecretStr("")
    """The bearer token every control RPC must carry (`authorization: Bearer <token>`);
    required when enabled. A resources server also derives its cookie and MCP token keys from
    it, so a replacement process with the same token accepts the crashed one's sessions."""
    instance: str = ""
    """The instance name, overriding the participant's own when set (an id: letters, digits,
    `._-`, not starting with `.` or `-`). Part of the checkpoint path, so a replacement must
    use the same one to restore."""
    grpc_address: str = "127.0.0.1:0"
    """HOST:PORT of the gRPC sidecar; port 0 picks a free port (`CheckpointRuntime.port`)."""
    health_address: str | None = None
    """HOST:PORT of a plaintext port serving grpc.health.v1.Health only (off by default), for
    the kubelet's native `grpc:` probes, which cannot speak TLS: it stays plaintext when the
    sidecar's port has TLS. It exposes health statuses alone (every other service answers
    UNIMPLEMENTED there) and takes no token."""
    lease_grace_seconds: float = Field(600.0, gt=0)
    """How long past a request's deadline an open checkpoint lives without a renewal. A lease
    that expires aborts the checkpoint as a Resume would (admission reopens), so a controller
    that died never leaves a participant closed for good."""
    heartbeat_seconds: float = Field(1.0, gt=0)
    """The interval of heartbeat messages on a Prepare stream that has nothing else to say."""
    max_deadline_seconds: float = Field(86400.0, gt=0)
    """The farthest ahead a request's deadline may lie (`INVALID_REQUEST` beyond), which
    bounds how long one request can keep a participant's admission closed."""
    allowed_checkpoint_roots: tuple[str, ...] = ()
    """Absolute directories Commit and Restore may use (resolved, symlinks included); empty
    allows any directory. A directory outside them is refused `INVALID_REQUEST`."""
    start_closed: bool = False
    """Start with admission closed until a Restore or Resume arrives: a replacement process
    then serves nothing before it is restored (a process that served cannot restore)."""
    start_closed_timeout_seconds: float | None = Field(None, gt=0)
    """With `start_closed`: open anyway after this long without a Restore or Resume (None:
    `lease_grace_seconds`), so a controller that never comes does not idle the process."""
    export_ended_sessions: bool = False
    """A resources server keeps a session that ended (a successful verify or close) exportable
    by a Commit whose scope names its episode (`server.resources.ended_sessions`): certify
    sets it to compare every session's final state with its baseline's, which a server that
    stops tracking a session at its verify would never export. Off by default: an ended
    session then leaves every checkpoint. Either way it never blocks a Prepare, is never
    listed as a live episode, and an unscoped Commit does not export it; at most
    `ENDED_SESSIONS_KEPT` (10,000) are kept, the oldest dropped first, and a Retire of the
    rollout frees one (`retire_session_state`)."""
    outbox_cap: int = Field(DEFAULT_OUTBOX_CAP, gt=0)
    """The most finished results an episode owner holds under receipts until the trainer
    acknowledges them (`server.runtime.result_outbox`); past it, a new run that asks for a
    receipt is refused, HTTP 429 `outbox_full` with `Retry-After`. Every held result is in
    every checkpoint, so this also bounds what unacknowledged results add to one."""
    readiness_pause_threshold_seconds: float = Field(30.0, gt=0)
    """How long a checkpoint may keep admission closed before the `participant-readiness`
    health turns NOT_SERVING; a shorter pause keeps the pod in its Service, so clients see no
    churn. Liveness never depends on a checkpoint."""
    incremental_full_every: int = Field(DEFAULT_FULL_EVERY, ge=1, le=MAX_FULL_EVERY)
    """For a server that declares `checkpoint_incremental`: a full part at least every this
    many parts, so a restore reads at most this many parts (1: every part is full)."""
    incremental_max_stale_share: float = Field(DEFAULT_MAX_STALE_SHARE, ge=0.0, le=1.0)
    """A full part as soon as more than this share of the bytes the last part references
    are records no longer referenced, which retention must keep all the same."""
    reflection: bool = False
    """Also serve gRPC server reflection (for grpcurl without the protos)."""
    tls_cert_file: str | None = None
    """The sidecar's TLS certificate chain (PEM); set with `tls_key_file`, or neither
    (plaintext)."""
    tls_key_file: str | None = None
    """The private key of `tls_cert_file` (PEM)."""
    tls_client_ca_file: str | None = None
    """Require client certificates signed by this CA (mutual TLS); needs `tls_cert_file`."""
    shutdown_grace_seconds: float = Field(5.0, ge=0)
    """On shutdown, how long RPCs in flight may still finish before they are cancelled."""
    max_message_bytes: int = Field(16 * 1024 * 1024, gt=0)
    """The largest gRPC message the sidecar receives or sends."""
    metrics_address: str | None = None
    """HOST:PORT of a Prometheus `/metrics` listener of its own (off by default)."""
    metrics_path: str | None = None
    """A path such as `/metrics` to serve Prometheus metrics on the HTTP app (off by default)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.enabled:
            return self
        if not self.token.get_secret_value():
            raise ValueError("checkpoint.token is required when checkpointing is enabled")
        if self.instance and not is_valid_id(self.instance):
            raise ValueError("checkpoint.instance must match ^[A-Za-z0-9][A-Za-z0-9._-]*$")
        if not _ADDRESS.fullmatch(self.grpc_address):
            raise ValueError("checkpoint.grpc_address must be HOST:PORT")
        self._check_health_address()
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("checkpoint.tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("client certificates need a server certificate")
        if self.metrics_address is not None and not _ADDRESS.fullmatch(self.metrics_address):
            raise ValueError("checkpoint.metrics_address must be HOST:PORT")
        if self.metrics_path is not None and not (
            self.metrics_path.startswith("/") and self.metrics_path != "/"
        ):
            raise ValueError("checkpoint.metrics_path must be an absolute path such as /metrics")
        for root in self.allowed_checkpoint_roots:
            if is_object_url(root):
                try:
                    parse_object_url(root)
                except ValueError as exc:
                    raise ValueError(
                        f"checkpoint.allowed_checkpoint_roots: {root}: {exc}"
                    ) from None
            elif not root.startswith("/"):
                raise ValueError(
                    "checkpoint.allowed_checkpoint_roots must be absolute paths or object-store "
                    "URLs (s3://bucket/prefix)"
                )
        return self

    def _check_health_address(self) -> None:
        """The health port on the sidecar's own port number would fail to bind (or, on
        another interface, be easy to mistake for it); say so here, not as a bind failure
        in the middle of the app's startup."""
        if self.health_address is None:
            return
        if not _ADDRESS.fullmatch(self.health_address):
            raise ValueError("checkpoint.health_address must be HOST:PORT")
        port = int(self.health_address.rsplit(":", 1)[1])
        if port != 0 and port == int(self.grpc_address.rsplit(":", 1)[1]):
            raise ValueError("checkpoint.health_address needs a port of its own")

    def control_settings(self) -> ControlSettings:
        """The subset the control plane reads (it imports no pydantic)."""
        return ControlSettings(
            lease_grace_seconds=self.lease_grace_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            max_deadline_seconds=self.max_deadline_seconds,
            allowed_checkpoint_roots=self.allowed_checkpoint_roots,
            start_closed=self.start_closed,
            start_closed_timeout_seconds=self.start_closed_timeout_seconds,
            readiness_pause_threshold_seconds=self.readiness_pause_threshold_seconds,
            outbox_cap=self.outbox_cap,
            incremental_full_every=self.incremental_full_every,
            incremental_max_stale_share=self.incremental_max_stale_share,
        )
