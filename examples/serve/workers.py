"""`serve --workers N`: N HTTP worker processes behind one port, one participant.

The main process binds the port and runs the control plane and the sidecar; each worker is
this same command with the worker variables set, minus the flags only the main process takes
(server/runtime/workers.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from typing import IO, Any

import uvicorn

from rollout_checkpoint.server.core.keep_alive import SERVER_IDLE_SECONDS
from rollout_checkpoint.server.core.stop_signals import PROCESS
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.runtime.worker_bridge import (
    WORKER_HTTP_FD_ENV,
    WORKER_INDEX_ENV,
    worker_http_socket,
)
from rollout_checkpoint.server.runtime.worker_pool import (
    Placement,
    WorkerPool,
    record_identity_by_session,
)
from rollout_checkpoint.server.runtime.workers import serve_with_workers

from .arguments import EXIT_USAGE, fail, split_address
from .kinds import NEMO_GYM_KINDS
from .user_app import UserApp, served_kind
from .uvicorn_server import GRACEFUL_SHUTDOWN_SECONDS, QuietServer

WORKER_KINDS = {
    "resources": Placement.SESSIONS,
    "environment": Placement.CLAIMS,
    "agent": Placement.CLAIMS,
}
"""Kinds that run with several workers, and where their restored records go: a resources
session lives across requests, so it goes back to the worker its cookie routes to; an
environment or agent episode lives inside one `/run`, so its record waits in the main
process for the worker that receives the replacement's run."""


MAIN_ONLY_FLAGS = {
    "--workers": True,
    "--grpc-address": True,
    "--health-address": True,
    "--start-closed": False,
}
"""Flags of the main process that a worker's command line leaves out (True: with a value)."""


def worker_command(argv: list[str]) -> list[str]:
    """A worker's command: this one without what only the main process takes."""
    command: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in MAIN_ONLY_FLAGS:
            skip = MAIN_ONLY_FLAGS[name] and "=" not in arg
            continue
        command.append(arg)
    # -P as `rollout-checkpoint serve` runs it: no working-directory folder shadows a package.
    return [sys.executable, "-P", "-m", "rollout_checkpoint.examples.serve", *command]


def refuse_for_workers(args: argparse.Namespace, user_app: UserApp | None = None) -> None:
    """Exit 2 with one line when `--workers` cannot apply (`user_app`: what
    `serve MODULE:ATTRIBUTE` named; a factory's kind is known only once it built its app)."""
    if args.workers < 1:
        fail(EXIT_USAGE, "--workers must be at least 1")
    if args.workers == 1:
        return
    kind = served_kind(args.server, user_app)
    if kind is None:
        fail(
            EXIT_USAGE,
            f"--workers applies to a ResourcesServer subclass of yours, not to the factory "
            f"{args.server}: the main process needs the kind before any worker builds the app",
        )
    if kind not in WORKER_KINDS or args.server in NEMO_GYM_KINDS:
        fail(
            EXIT_USAGE,
            f"--workers applies to resources, environment and agent servers, not {args.server}",
        )
    if args.mcp:
        fail(EXIT_USAGE, "--mcp does not apply with --workers (MCP tokens are not routed)")
    if args.no_checkpoint:
        fail(EXIT_USAGE, "--workers needs checkpointing (the sessions are routed by its bridge)")


def serve_main_of_workers(
    args: argparse.Namespace,
    argv: list[str],
    instance: str,
    checkpoint: CheckpointSettings,
    announce: IO[str],
    served_kind: str,
) -> None:
    """The main process of `--workers N`: the control plane, the sidecar and the workers."""
    import asyncio

    kind = Kind(served_kind)
    placement = WORKER_KINDS[kind.value]
    pool = WorkerPool(
        kind,
        instance,
        args.workers,
        placement=placement,
        identity=record_identity_by_session if placement is Placement.SESSIONS else None,
    )
    host, port = split_address(args.http_address)

    def announced(addresses: dict[str, Any]) -> None:
        line = {
            "http": addresses["http"],
            "grpc": addresses["grpc"],
            "instance": instance,
            "kind": kind.value,
            "pid": os.getpid(),
            "workers": addresses["workers"],
            "worker_pids": addresses["worker_pids"],
        }
        if addresses.get("health") is not None:
            line["health"] = addresses["health"]
        print(json.dumps(line), file=announce, flush=True)

    asyncio.run(
        serve_with_workers(
            pool,
            checkpoint,
            worker_command(argv),
            http_host=host,
            http_port=port,
            announce=announced,
            graceful_seconds=GRACEFUL_SHUTDOWN_SECONDS,
        )
    )


def serve_worker(args: argparse.Namespace, app: Any) -> None:
    """One worker of a `--workers N` server: the inherited HTTP socket and its own Unix
    socket (requests forwarded by a worker to the one that owns their session); no
    announcement (the main process announces) and no control port."""
    index = int(os.environ[WORKER_INDEX_ENV])
    shared = socket.socket(fileno=int(os.environ[WORKER_HTTP_FD_ENV]))
    own_path = worker_http_socket(index)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(own_path)  # left by the worker this one replaces
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own.bind(own_path)
    own.listen(256)
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level=args.log_level,
        log_config=None,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        timeout_keep_alive=SERVER_IDLE_SECONDS,
    )
    QuietServer(config).run(sockets=[shared, own])
    PROCESS.exit_if_received()
