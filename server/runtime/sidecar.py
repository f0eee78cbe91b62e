"""The gRPC sidecar: one grpc.aio server on the HTTP app's own event loop.

It serves ParticipantService and grpc.health.v1.Health (and reflection when configured),
authenticates control calls with the bearer token, and binds without SO_REUSEPORT so a stray
second sidecar on the same port fails loudly instead of silently taking half the calls.
Every service parses its own request bytes (core/rpc: handlers, standard_services), so
garbage is a typed INVALID_REQUEST, never UNKNOWN with a logged traceback.
"""

from __future__ import annotations

import logging

import grpc
from grpc import aio

from rollout_checkpoint.server.core.extras import REFLECTION, require
from rollout_checkpoint.server.core.rpc.auth import BearerTokenInterceptor
from rollout_checkpoint.server.core.rpc.standard_services import (
    HEALTH_SERVICE,
    REFLECTION_SERVICE,
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
        self._server: aio.Server | None = None

    @property
    def address(self) -> str:
        host = self.settings.grpc_address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> int:
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
        hostile = hostile_input_log()
        handlers = [self.servicer.generic_handler(), health_handler(self.health.servicer, hostile)]
        if self.settings.reflection:
            names = (SERVICE_NAME, HEALTH_SERVICE, REFLECTION_SERVICE)
            handlers.append(reflection_handler(names, hostile))
        server.add_generic_rpc_handlers(handlers)
        credentials = self._credentials()
        if credentials is None:
            self.port = server.add_insecure_port(self.settings.grpc_address)
        else:
            self.port = server.add_secure_port(self.settings.grpc_address, credentials)
        await self.control.start()
        await self.health.start()
        await server.start()
        self._server = server
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
        if self._server is not None:
            await self._server.stop(
                self.settings.shutdown_grace_seconds if grace is None else grace
            )
            self._server = None
        await self.control.close()

    def _credentials(self) -> grpc.ServerCredentials | None:
        return server_credentials(
            self.settings.tls_cert_file,
            self.settings.tls_key_file,
            self.settings.tls_client_ca_file,
        )
