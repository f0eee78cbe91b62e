"""Install checkpointing into a Starlette or FastAPI app, from one settings object.

Off by default: with `enabled: false` nothing at all is installed (no sidecar, no lifespan
change, no state), so a server behaves exactly as without this project.

The sidecar starts and stops inside the app's lifespan, on uvicorn's own loop: grpc.aio
objects are bound to the loop that creates them, and uvicorn re-raises SIGTERM after `serve()`
returns, so code placed after `serve()` would never run. Health turns NOT_SERVING from the
signal handler itself, before uvicorn drains HTTP connections, so the kubelet and the
controller learn of the shutdown at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.core.part_storage import CheckpointStorage
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.metrics import (
    DataPlaneRefusals,
    MetricsServer,
    metrics_endpoint,
)
from rollout_checkpoint.server.runtime.participant import Participant
from rollout_checkpoint.server.runtime.request_endings import RequestEndingsMiddleware
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.runtime.sidecar import Sidecar
from rollout_checkpoint.server.runtime.telemetry import RuntimeObserver
from rollout_checkpoint.server.runtime.worker_bridge import (
    WORKER_INDEX_ENV,
    WORKER_SOCKET_ENV,
    WorkerBridge,
)

log = logging.getLogger(__name__)

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class CheckpointRuntime:
    """What `install_checkpointing` put into the app (also at `app.state.checkpoint`).

    The participant's control plane (`control`), its gRPC sidecar, and the metrics. The app's
    lifespan calls `start` and `stop`; call them yourself only for an app whose lifespan does
    not run (tests). `start` also hooks SIGTERM/SIGINT (in the main thread) so health turns
    NOT_SERVING and control changes are refused before uvicorn drains HTTP, then chains to
    the handler that was installed before.
    """

    def __init__(
        self,
        control: ControlPlane,
        settings: CheckpointSettings,
        observer: RuntimeObserver | None = None,
    ) -> None:
        self.control = control
        self.settings = settings
        self.sidecar = Sidecar(control, settings)
        self.observer = observer or RuntimeObserver()
        self.metrics = self.observer.metrics
        self.metrics_server: MetricsServer | None = None
        if settings.metrics_address is not None:
            self.metrics_server = MetricsServer(self.metrics, settings.metrics_address)
        self._previous_handlers: dict[int, SignalHandler] = {}
        self._shutdown_task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int | None:
        """The sidecar's bound port (None before `start`): the real one for a `:0` address."""
        return self.sidecar.port

    @property
    def address(self) -> str:
        """HOST:PORT the sidecar listens on, with the bound port; meaningful after `start`."""
        return self.sidecar.address

    @property
    def health_address(self) -> str | None:
        """HOST:PORT of the plaintext health-only listener, bound port included (None when
        off); meaningful after `start`."""
        return self.sidecar.health_address

    @property
    def metrics_address(self) -> str | None:
        """Where the metrics listener of its own is bound (None when off)."""
        return None if self.metrics_server is None else self.metrics_server.address

    async def start(self) -> None:
        """Bind and start the sidecar (and the metrics listener), then hook the signals.

        Call once, on the loop that serves the app (grpc.aio objects are bound to the loop
        that creates them). With `start_closed` admission closes here, before any request.
        Raises when the address cannot be bound or a TLS file cannot be read: the app's
        startup fails, rather than serving a participant no controller can reach."""
        await self.sidecar.start()
        if self.metrics_server is not None:
            await self.metrics_server.start()
        self._hook_signals()

    async def stop(self) -> None:
        """Unhook the signals, refuse control changes, stop the sidecar within
        `shutdown_grace_seconds` (RPCs in flight get that long), then the metrics listener.
        Safe after a SIGTERM already began the shutdown."""
        self._unhook_signals()
        await self.sidecar.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()

    def _hook_signals(self) -> None:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if self._shutdown_task is None:
                self._shutdown_task = loop.create_task(self.sidecar.begin_shutdown())
            previous = self._previous_handlers.get(signum)
            if callable(previous):
                previous(signum, frame)
            else:  # nobody else handles it: behave as if we were not here
                signal.signal(signum, previous or signal.SIG_DFL)
                signal.raise_signal(signum)

        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous_handlers[signum] = signal.getsignal(signum)
                signal.signal(signum, on_signal)
            except ValueError:  # not the main thread (e.g. tests running the app in a thread)
                self._previous_handlers.pop(signum, None)

    def _unhook_signals(self) -> None:
        for signum, previous in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous)
        self._previous_handlers.clear()


def install_checkpointing(
    app: Starlette,
    participant: Participant,
    settings: CheckpointSettings | None,
    *,
    clock: Clock | None = None,
    storage: CheckpointStorage | None = None,
    tracer_provider: Any = None,
) -> CheckpointRuntime | None:
    """Wire a participant's control plane and sidecar into `app`'s lifespan.

    Returns None, and touches nothing, when checkpointing is off. Metrics go to a registry of
    this runtime's own (`runtime.metrics.registry`), served at `metrics_path` on the app
    and/or on `metrics_address`; spans go to `tracer_provider` (OpenTelemetry's global
    provider when None; nothing at all without OpenTelemetry).

    Call it once per app, before the app starts (Starlette refuses middleware added later),
    with one participant that no other control plane wraps; `settings.instance`, when set,
    overrides `participant.instance`. Adds the middlewares that answer a retired request 409
    and count data-plane refusals (outermost, so add the participant's own admission
    middleware before calling this, as `ResourcesServer.build_app` does), and the
    participant's own `data_plane_middleware` innermost (inside the rollout prefix, wherever
    the app added it: an episode owner's reply-delivery report). The sidecar binds
    only when the app starts (see `CheckpointRuntime.start`), so a bad address or TLS file
    fails the app's startup, not this call. `clock` and `storage` replace the real ones in
    tests. Serve the app with one worker (the sidecar lives in that process), or under
    `workers.serve_with_workers`: then this process is one of several workers
    (`WORKER_SOCKET_ENV` is set), the control plane and the sidecar live in the main process,
    and this installs the same data-plane middlewares with the participant driven over the
    local bridge (`install_worker`), and returns None.
    """
    if settings is None or not settings.enabled:
        return None
    if settings.instance:
        participant.instance = settings.instance
    if os.environ.get(WORKER_SOCKET_ENV):
        install_worker(app, participant)
        return None
    observer = RuntimeObserver(tracer_provider=tracer_provider)
    control = ControlPlane(
        participant, settings.control_settings(), storage=storage, clock=clock, observer=observer
    )
    runtime = CheckpointRuntime(control, settings, observer)
    app.state.checkpoint = runtime
    # Outermost but for the refusal counter, which then also counts the 409 `stale_attempt`
    # answered for a retired in-flight request.
    app.add_middleware(RequestEndingsMiddleware)
    app.add_middleware(DataPlaneRefusals, on_refusal=observer.data_refused)
    # Innermost, whatever the app adds later: inside the rollout prefix and next to the routes.
    app.user_middleware.extend(Middleware(wrap) for wrap in participant.data_plane_middleware())
    if settings.metrics_path is not None:
        # First, so no catch-all mount of the app shadows it; it is a GET, which the
        # admission middleware passes through untouched (never counted, never refused).
        app.router.routes.insert(
            0, Route(settings.metrics_path, metrics_endpoint(runtime.metrics), methods=["GET"])
        )
    original = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(lifespan_app: Any) -> AsyncIterator[Any]:
        async with original(lifespan_app) as state:
            await runtime.start()
            try:
                yield state
            finally:
                await runtime.stop()

    app.router.lifespan_context = lifespan
    return runtime


def install_worker(app: Starlette, participant: Participant) -> WorkerBridge:
    """Make `app` one worker of a multi-worker server (see `worker_bridge.py`): the same
    data-plane middlewares as `install_checkpointing`, the participant attached to the
    bridge, and a lifespan that registers with the main process before the first request
    (so a worker started while a checkpoint is open closes before it serves anything)."""
    bridge = WorkerBridge(
        participant, os.environ[WORKER_SOCKET_ENV], int(os.environ[WORKER_INDEX_ENV])
    )
    app.state.checkpoint_worker = bridge
    observer = RuntimeObserver()
    app.add_middleware(RequestEndingsMiddleware)
    app.add_middleware(DataPlaneRefusals, on_refusal=observer.data_refused)
    app.user_middleware.extend(Middleware(wrap) for wrap in participant.data_plane_middleware())
    original = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(lifespan_app: Any) -> AsyncIterator[Any]:
        async with original(lifespan_app) as state:
            await bridge.connect()
            try:
                yield state
            finally:
                await bridge.disconnect()

    app.router.lifespan_context = lifespan
    return bridge


def serve(
    app: Starlette, host: str, port: int, *, workers: int = 1, graceful_seconds: int = 10
) -> None:
    """Run `app` under uvicorn with one worker (the sidecar lives in that one process; see
    `workers.serve_with_workers` for several)."""
    import uvicorn

    from rollout_checkpoint.server.core.keep_alive import SERVER_IDLE_SECONDS

    if workers != 1:
        raise SystemExit(
            f"rollout-checkpoint: {workers} workers configured, but this runs exactly one worker "
            "process (the gRPC sidecar lives there); set workers to 1, or run several with "
            "rollout_checkpoint.server.runtime.workers.serve_with_workers"
        )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        timeout_graceful_shutdown=graceful_seconds,
        timeout_keep_alive=SERVER_IDLE_SECONDS,
    )
    uvicorn.Server(config).run()
