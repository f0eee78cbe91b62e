"""The gRPC sidecar: one grpc.aio server on the HTTP app's own event loop.

It serves ParticipantService and grpc.health.v1.Health (and reflection when configured),
authenticates control calls with the bearer token, and binds without SO_REUSEPORT so a stray
second sidecar on the same port fails loudly instead of silently taking half the calls.
Every service parses its own request bytes (core/rpc: handlers, standard_services), so
garbage is a typed INVALID_REQUEST, never UNKNOWN with a logged traceback. With
`health_address` a second, plaintext port serves the same health servicer and nothing else
(core/rpc/health_listener.py), for the kubelet's native `grpc:` probes when the control port
has TLS.
"""

from __future__ import annotations

import logging

import grpc
from grpc import aio

from rollout_checkpoint.server.core.extras import REFLECTION, require
from rollout_checkpoint.server.core.rpc.auth import BearerTokenInterceptor
from rollout_checkpoint.server.core.rpc.health_listener import (
    HealthListener,
    bind_health_listener,
    stop_with_health,
)
from rollout_checkpoint.server.core.rpc.standard_services import (
    HEALTH_SERVICE,
    REFLECTION_SERVICE,
    RateLimitedLog,
    health_handler,
    hostile_input_log,
    reflection_handler,
)
from rollout_checkpoint.server.core.rpc.tls import server_credentials
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.health import ParticipantHealth
from rollout_checkpoint.server.runtime.servicer import SERVICE_NAME, ParticipantServicer
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

log = logging.getLogger(__name__)


class Sidecar:
    """Start it from a running loop (the ASGI lifespan); stop it there too."""

    def __init__(self, control: ControlPlane, settings: CheckpointSettings) -> None:
        if settings.reflection:  # MissingExtra now, while the app is built, not in its lifespan
            require(REFLECTION, "reflection: true (CheckpointSettings.reflection)")
        self.control = control
        self.settings = settings
        self.servicer = ParticipantServicer(control)
        self.health = ParticipantHealth(control, (SERVICE_NAME,))
        self.port: int | None = None
        self.health_listener: HealthListener | None = None
        self._server: aio.Server | None = None

    @property
    def address(self) -> str:
        host = self.settings.grpc_address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def health_address(self) -> str | None:
        """HOST:PORT of the health-only listener with its bound port (None when off)."""
        listener = self.health_listener
        return None if listener is None else listener.bound_address

    async def start(self) -> int:
        hostile = hostile_input_log()
        server = self._control_server(hostile)
        credentials = self._credentials()
        if credentials is None:
            self.port = server.add_insecure_port(self.settings.grpc_address)
        else:
            self.port = server.add_secure_port(self.settings.grpc_address, credentials)
        self.health_listener = bind_health_listener(
            self.health.servicer, self.settings.health_address, hostile
        )
        await self.control.start()
        await self.health.start()
        await server.start()
        self._server = server
        if self.health_listener is not None:
            await self.health_listener.start()
            log.info("health only, plaintext, on %s", self.health_listener.bound_address)
        log.info(
            "checkpoint sidecar of %s/%s listening on %s",
            self.control.participant.kind.value,
            self.control.participant.instance,
            self.address,
        )
        return self.port

    async def begin_shutdown(self) -> None:
        """Health NOT_SERVING everywhere and control changes refused, at once."""
        await self.control.begin_shutdown()
        await self.health.shutdown()

    async def stop(self, grace: float | None = None) -> None:
        if not self.control.shutting_down:
            await self.begin_shutdown()
        server, self._server = self._server, None
        await stop_with_health(
            server,
            self.health_listener,
            self.settings.shutdown_grace_seconds if grace is None else grace,
        )
        await self.control.close()

    def _control_server(self, hostile: RateLimitedLog) -> aio.Server:
        """ParticipantService behind the token, health and (when configured) reflection."""
        limit = self.settings.max_message_bytes
        server = aio.server(
            interceptors=[
                BearerTokenInterceptor(
                    self.settings.token.get_secret_value(),
                    on_refusal=self.control.observer.unauthenticated,
                )
            ],
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ],
        )
        handlers = [self.servicer.generic_handler(), health_handler(self.health.servicer, hostile)]
        if self.settings.reflection:
            names = (SERVICE_NAME, HEALTH_SERVICE, REFLECTION_SERVICE)
            handlers.append(reflection_handler(names, hostile))
        server.add_generic_rpc_handlers(handlers)
        return server

    def _credentials(self) -> grpc.ServerCredentials | None:
        return server_credentials(
            self.settings.tls_cert_file,
            self.settings.tls_key_file,
            self.settings.tls_client_ca_file,
        )
