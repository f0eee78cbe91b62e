"""One `serve` process from its first line to its exit: signals, announcement, uvicorn."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import IO, Any

import uvicorn

from rollout_checkpoint.server.core.extras import MissingExtra
from rollout_checkpoint.server.core.keep_alive import SERVER_IDLE_SECONDS
from rollout_checkpoint.server.core.stop_signals import EXIT_CODES, PROCESS
from rollout_checkpoint.server.nemo_gym.servers import KEEP_ALIVE_SECONDS
from rollout_checkpoint.server.runtime.logs import configure_logging
from rollout_checkpoint.server.runtime.worker_bridge import (
    WORKER_SOCKET_ENV,
)

from .arguments import (
    EXIT_USAGE,
    check_free,
    fail,
    parse_args,
    refuse_inapplicable_flags,
    settings_or_exit,
    split_address,
)
from .build import build
from .kinds import NEMO_GYM_KINDS, default_instance, is_user_app
from .user_app import load, served_kind
from .uvicorn_server import GRACEFUL_SHUTDOWN_SECONDS, QuietServer
from .workers import refuse_for_workers, serve_main_of_workers, serve_worker


def announcement_stream() -> IO[str]:
    """The real stdout, for the one announcement line; `sys.stdout` becomes stderr.

    A reader takes the first line and may never drain the pipe, so anything else printed to
    stdout would fill it and block the server: NeMo Gym prints freely (its exception
    middleware, its validation handler), and so may any library a server imports."""
    announce = sys.stdout
    sys.stdout = sys.stderr
    return announce


def main(argv: list[str] | None = None) -> None:
    PROCESS.take()  # first: see stop_signals
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    announce = announcement_stream()  # before the user's module, which may print at import
    user_app = load(args.server) if is_user_app(args.server) else None
    refuse_inapplicable_flags(args, builds_its_own_app=user_app is not None and user_app.is_factory)
    refuse_for_workers(args, user_app)
    instance = args.instance or (
        user_app.default_instance if user_app is not None else default_instance(args.server)
    )
    if os.environ.get(WORKER_SOCKET_ENV):  # one worker of a `--workers N` main process
        configure_logging(
            args.log_level,
            json_lines=args.log_format == "json",
            secrets=[os.environ.get("ROLLOUT_CHECKPOINT_TOKEN", "")],
            stream=sys.stderr,
        )
        settings = settings_or_exit(args, instance)
        PROCESS.exit_if_received()
        app, _ = build(args, instance, settings, user_app)
        serve_worker(args, app)
        return
    checkpoint = settings_or_exit(args, instance)
    check_free("HTTP", args.http_address)
    if checkpoint is not None:
        check_free("gRPC", checkpoint.grpc_address)
        if checkpoint.health_address is not None:
            check_free("health", checkpoint.health_address)
    token = checkpoint.token.get_secret_value() if checkpoint is not None else args.token
    configure_logging(
        args.log_level,
        json_lines=args.log_format == "json",
        secrets=[token or ""],
        stream=sys.stderr,
    )
    PROCESS.exit_if_received()
    if args.workers > 1:
        assert checkpoint is not None  # refuse_for_workers
        kind = served_kind(args.server, user_app)
        assert kind is not None  # refuse_for_workers: a factory runs one process
        serve_main_of_workers(args, argv, instance, checkpoint, announce, kind)
        PROCESS.exit_if_received()
        return
    try:
        app, runtime = build(args, instance, checkpoint, user_app)
    except MissingExtra as error:  # --mcp without the mcp extra, nemo-gym:* without nemo-gym
        fail(EXIT_USAGE, str(error))
    host, port = split_address(args.http_address)

    class AnnouncingServer(QuietServer):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            bound = self.servers[0].sockets[0].getsockname()
            announcement = {
                "http": f"{host}:{bound[1]}",
                "grpc": runtime.address if runtime is not None else None,
                "instance": instance,
                "kind": served_kind(args.server, user_app, runtime),
                "pid": os.getpid(),
            }
            if runtime is not None and runtime.health_address is not None:
                announcement["health"] = runtime.health_address
            print(json.dumps(announcement), file=announce, flush=True)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level=args.log_level,
        log_config=None,  # uvicorn's lines go through the same (structured) handler
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        timeout_keep_alive=SERVER_IDLE_SECONDS,
    )
    if args.server in NEMO_GYM_KINDS:  # NeMo Gym's agents count on run_webserver()'s keep-alive
        config.timeout_keep_alive = KEEP_ALIVE_SECONDS
    AnnouncingServer(config).run()
    PROCESS.exit_if_received()


def run_main() -> None:
    """`main`, with a KeyboardInterrupt that still reaches here (raised by code rather than by
    a signal, or before `main` took the signals) ending as SIGINT does, without a traceback."""
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(EXIT_CODES[signal.SIGINT]) from None
