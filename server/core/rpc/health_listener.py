"""A plaintext port that serves grpc.health.v1.Health alone, for the kubelet's native probes.

The kubelet's `grpc:` probe speaks plaintext only, so a control port with TLS cannot be
probed natively, and an exec probe starts a fresh interpreter for every probe. This port is
the way out: plaintext even when the control port has TLS, and safe so, because it serves
nothing but the control port's own health servicer (statuses always agree, graceful shutdown
included). No control service and no reflection are registered on it, so grpc itself answers
every other method UNIMPLEMENTED before a handler runs, and there is no token to carry or to
leak. Health requests parse their own bytes here as on the control port (hostile input is a
typed INVALID_REQUEST, logged at most once a minute).
"""

from __future__ import annotations

import asyncio

from grpc import aio

from rollout_checkpoint.server.core.rpc.standard_services import (
    ListingHealthServicer,
    RateLimitedLog,
    health_handler,
)

MAX_REQUEST_BYTES = 64 * 1024
"""A health request is one service name; a bigger message is refused before it is parsed,
so an unauthenticated caller cannot make the process buffer the control port's 16 MiB."""


class HealthBindError(RuntimeError):
    """The health address cannot be bound (in use, or not an address of this host)."""

    def __init__(self, address: str) -> None:
        super().__init__(f"cannot bind the health address {address}")
        self.address = address


class HealthListener:
    """Bind with `bind` (before anything else starts, so a taken port fails the start
    cleanly), then `start` once the servicer holds every name, and `stop` with the control
    port."""

    def __init__(
        self, servicer: ListingHealthServicer, address: str, hostile: RateLimitedLog
    ) -> None:
        self.address = address
        self.port: int | None = None
        self._server = aio.server(
            options=[
                # As on the control port: a second process on the same port fails loudly.
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ],
        )
        self._server.add_generic_rpc_handlers([health_handler(servicer, hostile)])
        self._started = False

    @property
    def bound_address(self) -> str:
        """HOST:PORT with the bound port (the real one for `:0`); meaningful after `bind`."""
        host = self.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def bind(self) -> int:
        """Bind the plaintext port; raises `HealthBindError` when it cannot."""
        try:
            self.port = self._server.add_insecure_port(self.address)
        except RuntimeError:
            raise HealthBindError(self.address) from None
        return self.port

    async def start(self) -> None:
        await self._server.start()
        self._started = True

    async def stop(self, grace: float | None) -> None:
        """Stop within `grace` seconds (open Watch streams end then)."""
        if self._started:
            await self._server.stop(grace)
            self._started = False


def bind_health_listener(
    servicer: ListingHealthServicer, address: str | None, hostile: RateLimitedLog
) -> HealthListener | None:
    """A listener bound at `address` (not started), or None when no address is configured."""
    if address is None:
        return None
    listener = HealthListener(servicer, address, hostile)
    listener.bind()
    return listener


async def stop_with_health(
    server: aio.Server | None, listener: HealthListener | None, grace: float | None
) -> None:
    """Stop a control server and its health listener together, so the two graces overlap
    instead of adding up: open Watch streams can hold either for the whole grace."""
    await asyncio.gather(
        *([] if server is None else [server.stop(grace)]),
        *([] if listener is None else [listener.stop(grace)]),
    )
