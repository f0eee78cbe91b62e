"""A server with several worker processes behind one port, still one participant.

The main process binds the HTTP port once, runs the participant's control plane around a
`WorkerPool` and its gRPC sidecar (the only control port), and starts N workers: each is the
same server command, run with `WORKER_SOCKET_ENV` and friends set, so its
`install_checkpointing` attaches the participant to the local bridge instead of starting a
sidecar (worker_bridge.py). A worker that dies is started again in its place; if a
checkpoint is open it registers closed and the Prepare stays blocked (`WORKER_LOST`) until
Resume.

Why one inherited listening socket (uvicorn's own multi-worker model, which NeMo Gym's
`num_workers` uses) and not SO_REUSEPORT: with one socket every connection waits in one
accept queue that any live worker drains, so a worker that dies loses only the connections
it had accepted, and a restarted worker needs no bind of its own. With SO_REUSEPORT each
worker has its own queue, the kernel hashes new connections to a queue, and the connections
queued on a dead worker's socket are reset; a stray process binding the port with the same
option silently takes a share of the traffic. uvicorn's own supervisor (`workers=N`) cannot
be used as is: it blocks the main process's thread in its own signal loop, and this main
process must run the sidecar's asyncio loop.

The bridge socket and the workers' own HTTP sockets (for requests forwarded to the worker
that owns their session) live in a fresh directory only this user can enter, removed on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.core.stop_signals import PROCESS, StopSignals, held
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.install import CheckpointRuntime
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.runtime.telemetry import RuntimeObserver
from rollout_checkpoint.server.runtime.worker_bridge import (
    WORKER_COUNT_ENV,
    WORKER_DIR_ENV,
    WORKER_HTTP_FD_ENV,
    WORKER_INDEX_ENV,
    WORKER_SOCKET_ENV,
)
from rollout_checkpoint.server.runtime.worker_pool import WorkerPool

log = logging.getLogger(__name__)

START_SECONDS = 60.0
"""How long the main process waits for every worker's first registration before it gives up
(and exits non-zero): a Python start with the app's imports, on a loaded machine."""
RESTART_BACKOFF_SECONDS = (0.1, 0.5, 2.0)
"""Delays before restarting a worker that keeps dying (the last one repeats)."""


class WorkerSupervisor:
    """Starts the workers, restarts the ones that die, stops them all."""

    def __init__(
        self,
        command: Sequence[str],
        count: int,
        env: Mapping[str, str],
        http_socket: socket.socket,
    ) -> None:
        self.command = list(command)
        self.count = count
        self.env = dict(env)
        self.http_socket = http_socket
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = 0
        self.stopping = False
        """Set on SIGTERM/SIGINT: a worker that exits from now on is not restarted."""
        self._tasks: list[asyncio.Task[None]] = []
        self._spawning = asyncio.Lock()
        """One spawn at a time, and none once stopping (see `_spawn`)."""

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep(index)) for index in range(self.count)]

    async def _spawn(self, index: int) -> asyncio.subprocess.Process | None:
        """Start worker `index` with SIGINT and SIGTERM blocked (None once stopping): it
        inherits the mask, so a Ctrl-C reaching the whole group during its imports waits for
        its own handler (`stop_signals`) instead of printing a KeyboardInterrupt traceback.

        Spawns never overlap. `held` restores the mask it found, and two spans interleaved
        across their awaits end with the second restoring the first's "blocked": the main
        process then never sees a SIGTERM sent to it alone (the kubelet's), and the pod
        hangs until SIGKILL. And a worker is registered under the same lock that `stop`
        takes, so none can be spawned unseen by a stop and outlive it."""
        fd = self.http_socket.fileno()
        env = self.env | {WORKER_INDEX_ENV: str(index), WORKER_HTTP_FD_ENV: str(fd)}
        async with self._spawning:
            if self.stopping:
                return None
            with held():
                process = await asyncio.create_subprocess_exec(
                    *self.command,
                    env=env,
                    pass_fds=(fd,),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=2,
                )
            self.processes[index] = process
            return process

    async def _keep(self, index: int) -> None:
        failures = 0
        while (process := await self._spawn(index)) is not None:
            code = await process.wait()
            # A Ctrl-C on a terminal signals the whole group: the workers may exit before
            # the main process's own handler ran, so wait before deciding it was a crash.
            delay = RESTART_BACKOFF_SECONDS[min(failures, len(RESTART_BACKOFF_SECONDS) - 1)]
            failures += 1
            await asyncio.sleep(delay)
            if self.stopping:
                return
            self.restarts += 1
            log.warning("worker %d (pid %d) exited with %s: restarting", index, process.pid, code)

    async def stop(self, grace: float) -> None:
        """SIGTERM every worker (they drain their HTTP requests), SIGKILL what is left after
        `grace` seconds."""
        self.stopping = True
        async with self._spawning:  # a spawn under way finishes and is registered first
            pass
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        waits = [p.wait() for p in self.processes.values()]
        try:
            async with asyncio.timeout(grace):
                await asyncio.gather(*waits)
        except TimeoutError:
            for process in self.processes.values():
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def bind_http(host: str, port: int) -> socket.socket:
    """The one listening socket every worker inherits (see the module for why not
    SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048, reuse_port=False)
    sock.set_inheritable(True)
    return sock


async def serve_with_workers(
    pool: WorkerPool,
    settings: CheckpointSettings,
    worker_command: Sequence[str],
    *,
    http_host: str,
    http_port: int,
    announce: Callable[[dict[str, Any]], None] | None = None,
    worker_env: Mapping[str, str] | None = None,
    graceful_seconds: float = 10.0,
    clock: Clock | None = None,
    stop_signals: StopSignals = PROCESS,
) -> None:
    """Run `pool.configured` workers of `worker_command` behind one HTTP port, with the
    control plane and the sidecar here; returns after SIGTERM or SIGINT stopped everything.

    `worker_command` is the server's own command (`python -m ...`): run with the worker
    variables set, its `install_checkpointing` makes it a worker. `announce` gets the bound
    addresses once every worker registered. The token reaches the workers in their
    environment, never on a command line.

    The signals go through `stop_signals` (installed by the entry point before this loop
    existed, and still there after it is gone), not `loop.add_signal_handler`: closing the
    loop would put Python's defaults back while the workers are still being stopped, and a
    signal received before this started stops it at once."""
    private = tempfile.mkdtemp(prefix="rc-workers-")
    bridge_path = os.path.join(private, "bridge.sock")
    http_socket = bind_http(http_host, http_port)
    bound_port = http_socket.getsockname()[1]
    bridge = await asyncio.start_unix_server(pool.serve_connection, bridge_path)
    os.chmod(bridge_path, 0o600)
    observer = RuntimeObserver()
    control = ControlPlane(pool, settings.control_settings(), clock=clock, observer=observer)
    runtime = CheckpointRuntime(control, settings, observer)
    env = dict(os.environ if worker_env is None else worker_env) | {
        WORKER_SOCKET_ENV: bridge_path,
        WORKER_COUNT_ENV: str(pool.configured),
        WORKER_DIR_ENV: private,
        "ROLLOUT_CHECKPOINT_TOKEN": settings.token.get_secret_value(),
    }
    supervisor = WorkerSupervisor(worker_command, pool.configured, env, http_socket)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        supervisor.stopping = True
        stop.set()

    try:
        with stop_signals.stopping_with(lambda signum: loop.call_soon_threadsafe(on_signal)):
            address = f"{http_host}:{bound_port}"
            await _serve_until_stopped(pool, runtime, supervisor, stop, address, announce)
    finally:
        await runtime.sidecar.begin_shutdown()
        await supervisor.stop(graceful_seconds + 5)
        await runtime.sidecar.stop()
        if runtime.metrics_server is not None:
            await runtime.metrics_server.stop()
        bridge.close()
        http_socket.close()
        shutil.rmtree(private, ignore_errors=True)


async def _serve_until_stopped(
    pool: WorkerPool,
    runtime: CheckpointRuntime,
    supervisor: WorkerSupervisor,
    stop: asyncio.Event,
    http_address: str,
    announce: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Start the sidecar and the workers, announce once every worker registered, return once
    `stop` is set (a signal, before or after the announcement); exit 1 when the workers do
    not all start within `START_SECONDS`."""
    loop = asyncio.get_running_loop()
    await runtime.sidecar.start()
    if runtime.metrics_server is not None:
        await runtime.metrics_server.start()
    supervisor.start()
    waiting = loop.create_task(pool.wait_for_workers(START_SECONDS))
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if waiting.done() and not waiting.cancelled() and waiting.exception() is None:
        if announce is not None:
            announce(
                {
                    "http": http_address,
                    "grpc": runtime.address,
                    "health": runtime.health_address,
                    "workers": pool.configured,
                    "worker_pids": [p.pid for _, p in sorted(supervisor.processes.items())],
                }
            )
        await stopped
    else:
        waiting.cancel()
        stopped.cancel()
        if not stop.is_set():
            print(
                f"rollout-checkpoint: only {len(pool.workers)} of {pool.configured} "
                f"workers started within {START_SECONDS:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)
