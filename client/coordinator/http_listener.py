"""uvicorn serving an ASGI app inside the coordinator's own event loop (beside grpc.aio).

Inside, not in a thread or a process of its own: the app calls the servicer's methods, whose
grpc.aio channels and locks belong to this loop. uvicorn is driven by its parts (`startup`,
`main_loop`, `shutdown`) rather than `serve()`, because `serve()` takes over SIGTERM and
SIGINT for its run and raises them again afterwards, which would end the coordinator before
its graceful stop (the process's signals are `stop_signals`', owned by the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn
from starlette.types import ASGIApp

from rollout_checkpoint.server.core.keep_alive import SERVER_IDLE_SECONDS

GRACE_SECONDS = 5
"""How long a stop waits for open HTTP requests before closing their connections."""


class HttpBindError(RuntimeError):
    """The HTTP address cannot be bound (in use, or not an address of this host)."""

    def __init__(self, address: str) -> None:
        super().__init__(f"cannot bind the http address {address}")
        self.address = address


class HttpListener:
    """`bind` first (a taken port fails the start before anything serves), then `start` and
    `stop` with the coordinator."""

    def __init__(self, app: ASGIApp, address: str, tls: ssl.SSLContext | None = None) -> None:
        self.app = app
        self.address = address
        self.tls = tls
        self.port: int | None = None
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._ticks: asyncio.Task[None] | None = None

    @property
    def bound_address(self) -> str:
        """HOST:PORT with the bound port (the real one for `:0`); meaningful after `bind`."""
        host = self.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def bind(self) -> int:
        host, _, port = self.address.rpartition(":")
        try:
            family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
            # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on connections whose
            # socket says TCP, and without it every answer waited ~40 ms for a delayed ACK.
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        except (OSError, ValueError):
            raise HttpBindError(self.address) from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), int(port)))
            sock.listen(128)
        except (OSError, ValueError, OverflowError):
            sock.close()
            raise HttpBindError(self.address) from None
        sock.setblocking(False)
        self._socket = sock
        self.port = sock.getsockname()[1]
        return self.port

    async def start(self) -> None:
        assert self._socket is not None, "bind first"
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=GRACE_SECONDS,
            timeout_keep_alive=SERVER_IDLE_SECONDS,
        )
        config.load()
        # A context, not uvicorn's file options: the files were read and checked once, with
        # the gRPC port's (`tls.server_ssl_context`).
        config.ssl = self.tls
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._socket])
        self._server = server
        # Its ticks keep the Date header current and end when `should_exit` is set.
        self._ticks = asyncio.create_task(server.main_loop(), name="coordinator http")

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (at most `GRACE_SECONDS`), close."""
        server, self._server = self._server, None
        if server is not None:
            server.should_exit = True
            if self._ticks is not None:
                await self._ticks
            await server.shutdown(sockets=[self._socket] if self._socket else None)
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
            self._socket = None
