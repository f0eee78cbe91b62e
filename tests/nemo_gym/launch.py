"""Serve one of NeMo Gym's own resources servers outside `ng_run`, for our tests.

Run by the Python 3.12 env that `scripts/nemo-gym-env` prints (nemo-gym 0.4.0 from PyPI):

    $(scripts/nemo-gym-env) tests/nemo_gym/launch.py indirect_prompt_injection
    -> {"http": "127.0.0.1:40123", "grpc": null, "instance": "...", "kind": "nemo-gym:...", "pid": 4711}

`--checkpoint` wraps the server with `rollout_checkpoint.server.nemo_gym` (then `grpc` is the
sidecar's address); the interpreter must have rollout-checkpoint installed.

Why not `ng_run`: its `run_webserver()` reads the global config from a head server, starts
a Ray cluster and may fork uvicorn workers, none of which a test of one server needs (and
Ray alone costs seconds and gigabytes). Instead the server is built exactly as
`run_webserver()` builds it (the instance config, a `ServerClient` that is never called),
then `setup_webserver()` gives its FastAPI app, and by default the same three additions
`run_webserver()` makes to that app (the `GET /` liveness route, the exception middleware
that turns a handler's exception into a 500 with `repr(e)`, the logging validation-error
handler), so the HTTP behaviour is what a real NeMo Gym deployment serves. `--bare` serves
`setup_webserver()`'s app alone, the form an integration wraps.

The announcement convention is the one `rollout-checkpoint serve` uses: one JSON line on
stdout once the socket listens, nothing else ever on stdout. NeMo Gym and Ray print to
stdout freely (the exception middleware, the validation handler), so this script points
`sys.stdout` at stderr before importing them: a test reads only the first line and never
drains the pipe, and a full pipe would block the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

ANNOUNCE: IO[str] = sys.stdout
sys.stdout = sys.stderr


@dataclass(frozen=True)
class ServerKind:
    """Where one NeMo Gym server lives in the nemo-gym wheel (top-level packages)."""

    module: str
    server_class: str
    config_class: str
    # The instance name `ng_run` gives it with the package's own config file
    # (configs/<name>.yaml, top-level key). The session cookie's name and signing secret
    # are both f"{server_class}___{instance}", so using the same name as ng_run keeps
    # cookies interchangeable with a real deployment.
    instance: str


SERVERS: dict[str, ServerKind] = {
    "indirect_prompt_injection": ServerKind(
        "resources_servers.indirect_prompt_injection.app",
        "IPIResourcesServer",
        "IPIResourcesServerConfig",
        "indirect_prompt_injection_resources_server",
    ),
    "example_session_state_mgmt": ServerKind(
        "resources_servers.example_session_state_mgmt.app",
        "StatefulCounterResourcesServer",
        "StatefulCounterResourcesServerConfig",
        "example_session_state_mgmt_resources_server",
    ),
}


def build_server(kind: ServerKind, instance: str, host: str, port: int) -> Any:
    """The server object as `run_webserver()` would construct it, minus the global config.

    `ServerClient` is required by the model but only used to call *other* servers (agents
    and models), which a resources server never does; a head server at port 0 and an empty
    global config make any accidental use fail fast instead of reaching a real process.
    """
    import importlib

    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf

    module = importlib.import_module(kind.module)
    server_cls = getattr(module, kind.server_class)
    config_cls = getattr(module, kind.config_class)
    # The config class is the annotation of the server's `config` field (how
    # BaseServer.load_config_from_global_config finds it); check our table agrees.
    assert server_cls.model_fields["config"].annotation is config_cls, kind
    config = config_cls(host=host, port=port, entrypoint="app.py", name=instance)
    server_client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
        global_config_dict=OmegaConf.create({}),
    )
    return server_cls(config=config, server_client=server_client)


def add_run_webserver_layers(server: Any, app: FastAPI) -> None:
    """The app-level additions `SimpleServer.run_webserver()` makes after `setup_webserver()`.

    Left out on purpose: Ray, `set_ulimit`, log prefixing, profiling and the access-log
    filter, which change the process rather than what a client sees over HTTP.
    """
    from fastapi import Request
    from fastapi.exception_handlers import request_validation_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response

    server.setup_liveness(app)
    server.setup_exception_middleware(app)

    @app.exception_handler(RequestValidationError)
    async def validation_exception_handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        print(f"Hit validation exception! Errors: {json.dumps(exc.errors(), default=str)}")
        return await request_validation_exception_handler(request, exc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("server", choices=sorted(SERVERS))
    parser.add_argument("--instance", help="config.name (default: ng_run's instance name)")
    parser.add_argument("--http-address", default="127.0.0.1:0", help="HOST:PORT (0: free)")
    parser.add_argument("--bare", action="store_true", help="setup_webserver()'s app alone")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="checkpoint it with rollout_checkpoint.server.nemo_gym (token from "
        "$ROLLOUT_CHECKPOINT_TOKEN); the announcement then names the sidecar's grpc address",
    )
    parser.add_argument("--grpc-address", default="127.0.0.1:0", help="the sidecar's HOST:PORT")
    parser.add_argument(
        "--start-closed", action="store_true", help="a replacement: admission closed until restored"
    )
    args = parser.parse_args(argv)

    import uvicorn

    kind = SERVERS[args.server]
    instance = args.instance or kind.instance
    host, _, port = args.http_address.rpartition(":")
    server = build_server(kind, instance, host, int(port))
    app = server.setup_webserver()
    if not args.bare:
        add_run_webserver_layers(server, app)
    runtime = None
    if args.checkpoint:
        # The integration under test; needs rollout-checkpoint installed in this interpreter.
        from rollout_checkpoint.server.nemo_gym import checkpoint_nemo_gym_server
        from rollout_checkpoint.server.runtime.settings import CheckpointSettings

        settings = CheckpointSettings(
            enabled=True, grpc_address=args.grpc_address, start_closed=args.start_closed
        )
        installed = checkpoint_nemo_gym_server(server, app, settings)
        assert installed is not None
        runtime = installed.runtime

    class AnnouncingServer(uvicorn.Server):
        """Prints the announcement once uvicorn's socket listens (port 0 resolved)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            bound = self.servers[0].sockets[0].getsockname()
            announcement = {
                "http": f"{host}:{bound[1]}",
                "grpc": runtime.address if runtime is not None else None,
                "instance": instance,
                "kind": f"nemo-gym:{args.server}",
                "pid": os.getpid(),
            }
            print(json.dumps(announcement), file=ANNOUNCE, flush=True)

    # run_webserver()'s timeouts (its graceful shutdown is 0.5 s; uvicorn types it int).
    config = uvicorn.Config(
        app,
        host=host,
        port=int(port),
        log_level=args.log_level,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=30,
    )
    AnnouncingServer(config).run()


if __name__ == "__main__":
    main()
