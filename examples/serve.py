"""Run one fleet server (an example, or one of NeMo Gym's own) with its checkpoint sidecar.

    python -m rollout_checkpoint.examples.serve counter --http-address 127.0.0.1:0
    python -m rollout_checkpoint.examples.serve policy_model --latency 0.05
    python -m rollout_checkpoint.examples.serve agent --model-url http://127.0.0.1:8001 \
        --resources prompt_injection=http://127.0.0.1:8002
    python -m rollout_checkpoint.examples.serve environment --agent-url http://127.0.0.1:8003
    python -m rollout_checkpoint.examples.serve nemo-gym:indirect_prompt_injection
    python -m rollout_checkpoint.examples.serve prompt_injection --workers 4

`--workers N` (resources, environment and agent servers) runs N HTTP worker processes behind the
one port and keeps ONE participant: this process binds the port, runs the control plane and the
sidecar, and starts the workers as this same command with the worker variables set
(server/runtime/workers.py); its announcement adds `workers` and `worker_pids`.

Once HTTP and gRPC both listen it prints one JSON line to stdout (`http`, `grpc`, `instance`,
`kind`, `pid`, and `health` when a health-only port is configured) so scripts and tests can
find it; nothing else ever goes to stdout. SIGTERM shuts it down gracefully: health goes
NOT_SERVING at once, HTTP drains, then the sidecar stops. SIGINT does the same. At any moment,
from the imports to the shutdown, either one ends it without a traceback, with 0 (SIGTERM) or
130 (SIGINT): `stop_signals` says how.

`nemo-gym:<server>` serves one of NeMo Gym's own resources servers (`indirect_prompt_injection`,
`example_session_state_mgmt`) from the nemo-gym installed in this environment, built as
`ng_run` builds it but without Ray (`rollout_checkpoint.server.nemo_gym.servers`), checkpointed
with the shipped hooks; its instance name defaults to ng_run's, which also keys its cookies.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import IO, Any, NoReturn

import uvicorn
from pydantic import ValidationError

from rollout_checkpoint.client.cli.console import ExitCode, HelpFormatter, epilog
from rollout_checkpoint.server.core.extras import NEMO_GYM, MissingExtra, require
from rollout_checkpoint.server.core.stop_signals import EXIT_CODES, PROCESS, StopSignals
from rollout_checkpoint.server.nemo_gym.servers import KEEP_ALIVE_SECONDS
from rollout_checkpoint.server.nemo_gym.servers import SERVERS as NEMO_GYM_SERVERS
from rollout_checkpoint.server.resources import ResourcesServer, ResourcesServerConfig
from rollout_checkpoint.server.runtime.install import CheckpointRuntime
from rollout_checkpoint.server.runtime.logs import configure_logging
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.server.runtime.worker_bridge import (
    WORKER_HTTP_FD_ENV,
    WORKER_INDEX_ENV,
    WORKER_SOCKET_ENV,
    worker_http_socket,
)
from rollout_checkpoint.server.runtime.worker_pool import (
    Placement,
    WorkerPool,
    record_identity_by_session,
)
from rollout_checkpoint.server.runtime.workers import serve_with_workers

RESOURCES = {
    "weather": "rollout_checkpoint.examples.weather:WeatherServer",
    "counter": "rollout_checkpoint.examples.counter:CounterServer",
    "prompt_injection": "rollout_checkpoint.examples.prompt_injection:PromptInjectionServer",
}
GRACEFUL_SHUTDOWN_SECONDS = 10
"""uvicorn's graceful-shutdown timeout: how long SIGTERM waits for HTTP requests to finish
(before the sidecar's own `shutdown_grace_seconds`); deploy/kubernetes sizes
terminationGracePeriodSeconds from both."""
NEMO_GYM_PREFIX = "nemo-gym:"
NEMO_GYM_KINDS = {f"{NEMO_GYM_PREFIX}{name}": kind for name, kind in NEMO_GYM_SERVERS.items()}
"""NeMo Gym's own servers, by the name `serve` takes (`nemo-gym:<NeMo Gym's package name>`)."""
KINDS = (
    {name: "resources" for name in RESOURCES}
    | {
        "policy_model": "model",
        "agent": "agent",
        "environment": "environment",
    }
    | {name: "resources" for name in NEMO_GYM_KINDS}
)
NOT_FOR_NEMO_GYM = {
    "mcp": "--mcp",
    "session_secret": "--session-secret",
}
"""Resources flags a NeMo Gym server cannot honour (it has no MCP endpoint of ours, and its
cookie secret is its own, derived from its class and instance name): refused rather than
silently ignored, since a secret the operator set and we dropped would be a surprise."""


def server_class(name: str) -> type[ResourcesServer]:
    module, _, attribute = RESOURCES[name].partition(":")
    cls: type[ResourcesServer] = getattr(importlib.import_module(module), attribute)
    return cls


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rollout-checkpoint serve",
        description=__doc__.splitlines()[0].rstrip(".")
        + ". Prints one JSON line (http, grpc, instance, kind, pid; health with "
        "--health-address) once both listen.",
        epilog=epilog(
            "ROLLOUT_CHECKPOINT_TOKEN=change-me rollout-checkpoint serve counter "
            "--http-address 127.0.0.1:8001 --grpc-address 127.0.0.1:9001",
            "servers: " + ", ".join(f"{name} ({kind})" for name, kind in sorted(KINDS.items())),
            "nemo-gym:<server>: NeMo Gym's own server, from the nemo-gym installed in this "
            "environment (tested: 0.4.0 on Python 3.12); --instance defaults to ng_run's.",
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "server",
        choices=sorted(KINDS),
        metavar="SERVER",
        help="which server to run (servers: below)",
    )
    parser.add_argument(
        "--http-address", default="127.0.0.1:0", help="HOST:PORT (port 0 picks a free one)"
    )
    parser.add_argument(
        "--grpc-address", default=None, help="the sidecar's HOST:PORT (default 127.0.0.1:0)"
    )
    parser.add_argument(
        "--health-address",
        default=None,
        help="HOST:PORT of a plaintext port serving gRPC health only, for Kubernetes' native "
        "grpc: probes (default: none; $ROLLOUT_CHECKPOINT_HEALTH_ADDRESS)",
    )
    parser.add_argument(
        "--token", default=None, help="control token (else $ROLLOUT_CHECKPOINT_TOKEN)"
    )
    parser.add_argument("--no-checkpoint", action="store_true", help="run without checkpointing")
    parser.add_argument(
        "--instance",
        default=None,
        help="instance name (default: the server's name; nemo-gym:<server>: ng_run's "
        "instance name, which also names its session cookie and secret)",
    )
    parser.add_argument(
        "--start-closed",
        action="store_true",
        help="start with admission closed (a replacement process)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="HTTP worker processes behind the one port (resources and environment servers; "
        "still one participant: the sidecar runs in the main process)",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one object per line (with checkpoint_id and trace_id)",
    )
    resources = parser.add_argument_group("resources servers")
    resources.add_argument(
        "--mcp", action="store_true", help="also serve the tools over MCP at /mcp"
    )
    resources.add_argument(
        "--session-secret",
        default=None,
        help="cookie secret (else $ROLLOUT_CHECKPOINT_SESSION_SECRET, else derived)",
    )
    model = parser.add_argument_group("policy_model")
    model.add_argument(
        "--latency", type=float, default=0.05, help="seconds per scripted generation"
    )
    model.add_argument(
        "--token-latency",
        type=float,
        default=0.0,
        help="seconds per generated token on top of --latency (generation cuts)",
    )
    model.add_argument(
        "--upstream",
        default=None,
        help="proxy to this OpenAI-compatible server instead of scripting",
    )
    model.add_argument(
        "--upstream-continuation",
        choices=["none", "vllm"],
        default="none",
        help="how the upstream continues a generation cut's prefix (vllm: "
        "continue_final_message; none: cut calls are generated again)",
    )
    agent = parser.add_argument_group("agent")
    agent.add_argument("--model-url", default=None, help="the policy model's base URL")
    agent.add_argument(
        "--resources",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a resources server by fleet name (repeat)",
    )
    environment = parser.add_argument_group("environment")
    environment.add_argument("--agent-url", default=None, help="the agent's base URL")
    environment.add_argument(
        "--resources-server",
        default="prompt_injection",
        help="the fleet name the agent uses for tools",
    )
    return parser.parse_args(argv)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def checkpoint_settings(args: argparse.Namespace, instance: str) -> CheckpointSettings | None:
    if args.no_checkpoint:
        return None
    overrides: dict[str, Any] = {"enabled": True, "instance": instance}
    if args.start_closed:  # else $ROLLOUT_CHECKPOINT_START_CLOSED decides (Kubernetes sets it)
        overrides["start_closed"] = True
    if args.token is not None:
        overrides["token"] = args.token
    if args.grpc_address is not None:
        overrides["grpc_address"] = args.grpc_address
    if args.health_address is not None:
        overrides["health_address"] = args.health_address
    return CheckpointSettings(**overrides)


def default_instance(server: str) -> str:
    """The instance name when `--instance` is not given: the server's name, or for a NeMo
    Gym server the one `ng_run` gives it (its cookie's name and secret derive from it)."""
    if server in NEMO_GYM_KINDS:
        return NEMO_GYM_KINDS[server].instance
    return server


def build_nemo_gym(
    server: str, instance: str, http_address: str, checkpoint: CheckpointSettings | None
) -> tuple[Any, CheckpointRuntime | None]:
    """One of NeMo Gym's own servers, as `ng_run`'s `run_webserver()` serves it, checkpointed
    with the shipped hooks. Raises `MissingExtra` (exit 2) without nemo-gym or without this
    server in the installed nemo-gym, before anything is built."""
    # Imported here: the integration imports nemo-gym's session key when it installs.
    from rollout_checkpoint.server.nemo_gym import (
        add_run_webserver_layers,
        build_server,
        checkpoint_nemo_gym_server,
    )

    kind = NEMO_GYM_KINDS[server]
    require(replace(NEMO_GYM, modules=(*NEMO_GYM.modules, kind.module)), server)
    host, port = _split(http_address)
    nemo_gym_server = build_server(kind, instance, host, port)
    app = nemo_gym_server.setup_webserver()
    add_run_webserver_layers(nemo_gym_server, app)
    installed = checkpoint_nemo_gym_server(nemo_gym_server, app, checkpoint)
    return app, installed.runtime if installed is not None else None


def build(
    args: argparse.Namespace, instance: str, checkpoint: CheckpointSettings | None
) -> tuple[Any, CheckpointRuntime | None]:
    """The app and its checkpoint runtime for the chosen server."""
    if args.server in NEMO_GYM_KINDS:
        return build_nemo_gym(args.server, instance, args.http_address, checkpoint)
    if args.server in RESOURCES:
        config = ResourcesServerConfig(
            instance=instance,
            checkpoint=checkpoint,
            session_secret=args.session_secret
            or os.environ.get("ROLLOUT_CHECKPOINT_SESSION_SECRET")
            or None,
            expose_tools_over_mcp=True if args.mcp else None,
        )
        resources = server_class(args.server)(config)
        return resources.build_app(), resources.runtime
    if args.server == "policy_model":
        from rollout_checkpoint.examples.policy_model import PolicyModelConfig, PolicyModelServer

        model = PolicyModelServer(
            PolicyModelConfig(
                instance=instance,
                checkpoint=checkpoint,
                latency=args.latency,
                token_latency=args.token_latency,
                upstream=args.upstream,
                upstream_continuation=args.upstream_continuation,
            )
        )
        return model.build_app(), model.runtime
    if args.server == "agent":
        from rollout_checkpoint.examples.agent import AgentConfig, AgentServer

        if args.model_url is None:
            fail(EXIT_USAGE, "agent: --model-url is required")
        servers = dict(item.split("=", 1) for item in args.resources)
        agent = AgentServer(
            AgentConfig(
                instance=instance, model_url=args.model_url, servers=servers, checkpoint=checkpoint
            )
        )
        return agent.build_app(), agent.runtime
    from rollout_checkpoint.examples.environment import EnvironmentConfig, EnvironmentServer

    if args.agent_url is None:
        fail(EXIT_USAGE, "environment: --agent-url is required")
    environment = EnvironmentServer(
        EnvironmentConfig(
            instance=instance,
            agent_url=args.agent_url,
            resources_server=args.resources_server,
            checkpoint=checkpoint,
        )
    )
    return environment.build_app(), environment.runtime


EXIT_USAGE = ExitCode.USAGE
EXIT_ADDRESS_IN_USE = ExitCode.ADDRESS_IN_USE


def fail(code: int, message: str) -> NoReturn:
    """One line on stderr and `code`: a configuration mistake is not a crash to debug."""
    print(f"rollout-checkpoint serve: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def settings_or_exit(args: argparse.Namespace, instance: str) -> CheckpointSettings | None:
    """The checkpoint settings, or exit 2 with one line saying what to set."""
    try:
        return checkpoint_settings(args, instance)
    except ValidationError as error:
        if any("token" in str(e.get("msg", "")) for e in error.errors()):
            fail(EXIT_USAGE, "no control token: set ROLLOUT_CHECKPOINT_TOKEN or pass --token")
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or 'checkpoint'}: {e['msg']}"
            for e in error.errors()
        )
        fail(EXIT_USAGE, f"invalid checkpoint settings: {problems}")


def check_free(label: str, address: str) -> None:
    """Exit 8 with one line when `address` cannot be listened on.

    Checked before starting, with a plain socket: gRPC's own bind failure surfaces as a
    20-line traceback from inside the app's lifespan, and gRPC would even share a port with
    another gRPC server (SO_REUSEPORT). A port taken between this check and the real bind
    still fails, the long way."""
    try:
        host, port = _split(address)
    except ValueError:
        fail(EXIT_USAGE, f"{label} address {address!r} is not HOST:PORT")
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except OSError as error:
        fail(EXIT_ADDRESS_IN_USE, f"cannot listen on {label} address {address}: {error}")
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as error:
            reason = "in use" if error.errno == errno.EADDRINUSE else error.strerror
            fail(EXIT_ADDRESS_IN_USE, f"cannot listen on {label} address {address}: {reason}")


def refuse_inapplicable_flags(args: argparse.Namespace) -> None:
    """Exit 2 with one line for a flag the chosen server cannot honour."""
    if args.server in NEMO_GYM_KINDS:
        for attribute, flag in NOT_FOR_NEMO_GYM.items():
            if getattr(args, attribute):
                fail(EXIT_USAGE, f"{flag} does not apply to {args.server}")


def announcement_stream() -> IO[str]:
    """The real stdout, for the one announcement line; `sys.stdout` becomes stderr.

    A reader takes the first line and may never drain the pipe, so anything else printed to
    stdout would fill it and block the server: NeMo Gym prints freely (its exception
    middleware, its validation handler), and so may any library a server imports."""
    announce = sys.stdout
    sys.stdout = sys.stderr
    return announce


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


def refuse_for_workers(args: argparse.Namespace) -> None:
    """Exit 2 with one line when `--workers` cannot apply."""
    if args.workers < 1:
        fail(EXIT_USAGE, "--workers must be at least 1")
    if args.workers == 1:
        return
    kind = KINDS[args.server]
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
) -> None:
    """The main process of `--workers N`: the control plane, the sidecar and the workers."""
    import asyncio

    kind = Kind(KINDS[args.server])
    placement = WORKER_KINDS[kind.value]
    pool = WorkerPool(
        kind,
        instance,
        args.workers,
        placement=placement,
        identity=record_identity_by_session if placement is Placement.SESSIONS else None,
    )
    host, port = _split(args.http_address)

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
    )
    QuietServer(config).run(sockets=[shared, own])
    PROCESS.exit_if_received()


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


def main(argv: list[str] | None = None) -> None:
    PROCESS.take()  # first: see stop_signals
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    announce = announcement_stream()
    refuse_inapplicable_flags(args)
    refuse_for_workers(args)
    if os.environ.get(WORKER_SOCKET_ENV):  # one worker of a `--workers N` main process
        instance = args.instance or default_instance(args.server)
        configure_logging(
            args.log_level,
            json_lines=args.log_format == "json",
            secrets=[os.environ.get("ROLLOUT_CHECKPOINT_TOKEN", "")],
            stream=sys.stderr,
        )
        settings = settings_or_exit(args, instance)
        PROCESS.exit_if_received()
        app, _ = build(args, instance, settings)
        serve_worker(args, app)
        return
    instance = args.instance or default_instance(args.server)
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
        serve_main_of_workers(args, argv, instance, checkpoint, announce)
        PROCESS.exit_if_received()
        return
    try:
        app, runtime = build(args, instance, checkpoint)
    except MissingExtra as error:  # --mcp without the mcp extra, nemo-gym:* without nemo-gym
        fail(EXIT_USAGE, str(error))
    host, port = _split(args.http_address)

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
                "kind": KINDS[args.server],
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


if __name__ == "__main__":
    run_main()
