"""Build NeMo Gym's own resources servers outside `ng_run`: what `serve nemo-gym:<server>` runs.

    kind = SERVERS["indirect_prompt_injection"]
    server = build_server(kind, host="127.0.0.1", port=8000)
    app = server.setup_webserver()
    add_run_webserver_layers(server, app)  # what ng_run's run_webserver() adds to the app

Why not `ng_run`: its `run_webserver()` reads the global config from a head server, starts
a Ray cluster and may fork uvicorn workers, none of which one resources server needs (Ray
alone costs seconds and gigabytes). The server is built exactly as `run_webserver()` builds
it (the instance config, a `ServerClient` that is never called), `setup_webserver()` gives
its FastAPI app, and `add_run_webserver_layers` makes the app-level additions
`run_webserver()` makes, so a client sees what a real NeMo Gym deployment serves.

This module imports nothing of ours and nothing of nemo-gym at load (nemo-gym and fastapi only
inside the functions): `tests/nemo_gym/launch.py` loads this very file by path in nemo-gym's
own environment, where rollout-checkpoint is not installed, to serve the servers *without*
us; both ways then build them with the same code.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = [
    "KEEP_ALIVE_SECONDS",
    "SERVERS",
    "ServerKind",
    "add_run_webserver_layers",
    "build_server",
]

KEEP_ALIVE_SECONDS: Final = 30
"""uvicorn's keep-alive as `run_webserver()` sets it: longer than its agents' aiohttp
clients keep an idle connection, so the server never closes one a client is about to reuse."""


@dataclass(frozen=True)
class ServerKind:
    """Where one NeMo Gym server lives in the nemo-gym wheel (top-level packages)."""

    module: str
    server_class: str
    config_class: str
    instance: str
    """The instance name `ng_run` gives it from the package's own config file
    (configs/<name>.yaml, its top-level key). The session cookie's name and signing secret
    are both f"{server_class}___{instance}", so the same name keeps cookies interchangeable
    with a real deployment, and between a crashed process and its replacement."""


SERVERS: Final[dict[str, ServerKind]] = {
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
"""The servers we ship session hooks for (`hooks.ready_hooks`), by NeMo Gym's package name."""


def build_server(
    kind: ServerKind, instance: str | None = None, host: str = "127.0.0.1", port: int = 0
) -> Any:
    """The server object as `run_webserver()` would construct it, minus the global config.

    `instance` is its `config.name` (default: ng_run's); `host` and `port` only fill the
    config (`run_webserver()` reads them, `setup_webserver()` does not). `ServerClient` is
    required by the model but only calls *other* servers (agents and models), which a
    resources server never does; a head server at port 0 and an empty global config make any
    accidental use fail fast instead of reaching a real process. Raises ImportError without
    nemo-gym (or without this server in it).
    """
    module = importlib.import_module(kind.module)
    server_cls = getattr(module, kind.server_class)
    config_cls = getattr(module, kind.config_class)
    # The config class is the annotation of the server's `config` field (how
    # BaseServer.load_config_from_global_config finds it): a nemo-gym whose classes moved
    # fails here, not with a confusing validation error.
    declared = server_cls.model_fields["config"].annotation
    if declared is not config_cls:
        raise TypeError(f"{kind.server_class}.config is {declared!r}, not {kind.config_class}")
    config = config_cls(host=host, port=port, entrypoint="app.py", name=instance or kind.instance)
    base_server_config = importlib.import_module("nemo_gym.config_types").BaseServerConfig
    server_client_cls = importlib.import_module("nemo_gym.server_utils").ServerClient
    omegaconf = importlib.import_module("omegaconf").OmegaConf
    server_client = server_client_cls(
        head_server_config=base_server_config(host="127.0.0.1", port=0),
        global_config_dict=omegaconf.create({}),
    )
    return server_cls(config=config, server_client=server_client)


def add_run_webserver_layers(server: Any, app: FastAPI) -> None:
    """The app-level additions `SimpleServer.run_webserver()` makes after `setup_webserver()`:
    `GET /` liveness, the exception middleware (a handler's exception becomes a 500 with
    `repr(e)`), and the handler that prints a request's validation errors before the 422.

    Left out on purpose: Ray, `set_ulimit`, log prefixing, profiling and the access-log
    filter, which change the process rather than what a client sees over HTTP. `serve` calls
    it before `checkpoint_nemo_gym_server`, so the exception middleware sits outside NeMo
    Gym's session as under `run_webserver()`, and our rollout prefix outside everything.
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
