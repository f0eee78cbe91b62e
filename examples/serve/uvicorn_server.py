"""uvicorn as every `serve` process runs it (the main process and each worker alike).

One class for both, so a worker stops on SIGTERM exactly as a single process does: with this
process's one signal handler and the app's lifespan shutdown always run.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from rollout_checkpoint.server.core.stop_signals import PROCESS, StopSignals

GRACEFUL_SHUTDOWN_SECONDS = 10
"""uvicorn's graceful-shutdown timeout: how long SIGTERM waits for HTTP requests to finish
(before the sidecar's own `shutdown_grace_seconds`); deploy/kubernetes sizes
terminationGracePeriodSeconds from both."""


class QuietServer(uvicorn.Server):
    """uvicorn, with this process's one signal handler (`stop_signals`).

    uvicorn's own `capture_signals` replaces the handlers for its run, restores the previous
    ones and then raises the caught signal again: into Python's defaults that is a
    KeyboardInterrupt traceback (SIGINT) or a death by SIGTERM, in every worker as well. Here
    a signal only asks uvicorn to stop (a second SIGINT: without waiting for connections), and
    a signal that came before uvicorn started stops it as soon as it has."""

    stop_signals: StopSignals = PROCESS

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with self.stop_signals.stopping_with(lambda signum: self.handle_exit(signum, None)):
            yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, and the app's (the lifespan's: health NOT_SERVING, the sidecar's
        stop) even after a second SIGINT: uvicorn's `force_exit` skips it, the sidecar would
        then be torn down by the loop's cancellation of everything, logging tracebacks. Run
        again after uvicorn ran it, the lifespan's shutdown returns at once."""
        await super().shutdown(sockets)
        if self.force_exit:
            await self.lifespan.shutdown()
