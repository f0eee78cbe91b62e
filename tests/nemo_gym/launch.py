"""Serve one of NeMo Gym's own resources servers outside `ng_run`, *without* rollout-checkpoint.

Run by the Python 3.12 env that `scripts/nemo-gym-env` prints (nemo-gym 0.4.0 from PyPI,
and nothing of ours installed):

    $(scripts/nemo-gym-env) tests/nemo_gym/launch.py indirect_prompt_injection
    -> {"http": "127.0.0.1:40123", "grpc": null, "instance": "...", "kind": "nemo-gym:...", "pid": 4711}

The reference for "as without us": the server is built by the very code
`rollout-checkpoint serve nemo-gym:<server>` runs (`server/nemo_gym/servers.py`, which
imports nothing of ours, loaded here by its file path since the package is not installed in
this env): `build_server`, `setup_webserver()` and by default the three app additions
`run_webserver()` makes (`add_run_webserver_layers`), so the HTTP behaviour is what a real
NeMo Gym deployment serves. `--bare` serves `setup_webserver()`'s app alone, the form an
integration wraps. To checkpoint one, run `rollout-checkpoint serve nemo-gym:<server>` from
an env with both installed (tests/test_nemo_gym_checkpoint.py).

The announcement convention is the one `rollout-checkpoint serve` uses: one JSON line on
stdout once the socket listens, nothing else ever on stdout. NeMo Gym and Ray print to
stdout freely (the exception middleware, the validation handler), so this script points
`sys.stdout` at stderr before importing them: a test reads only the first line and never
drains the pipe, and a full pipe would block the server.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import IO, Any

ANNOUNCE: IO[str] = sys.stdout
sys.stdout = sys.stderr

SERVERS_MODULE = Path(__file__).resolve().parents[2] / "server" / "nemo_gym" / "servers.py"


def load_servers() -> ModuleType:
    """`rollout_checkpoint.server.nemo_gym.servers`, from its file (not installed here)."""
    spec = importlib.util.spec_from_file_location("nemo_gym_servers", SERVERS_MODULE)
    assert spec is not None and spec.loader is not None, SERVERS_MODULE
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    servers = load_servers()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("server", choices=sorted(servers.SERVERS))
    parser.add_argument("--instance", help="config.name (default: ng_run's instance name)")
    parser.add_argument("--http-address", default="127.0.0.1:0", help="HOST:PORT (0: free)")
    parser.add_argument("--bare", action="store_true", help="setup_webserver()'s app alone")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    import uvicorn

    kind = servers.SERVERS[args.server]
    instance = args.instance or kind.instance
    host, _, port = args.http_address.rpartition(":")
    server = servers.build_server(kind, instance, host, int(port))
    app = server.setup_webserver()
    if not args.bare:
        servers.add_run_webserver_layers(server, app)

    class AnnouncingServer(uvicorn.Server):
        """Prints the announcement once uvicorn's socket listens (port 0 resolved)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            bound = self.servers[0].sockets[0].getsockname()
            announcement = {
                "http": f"{host}:{bound[1]}",
                "grpc": None,
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
        timeout_keep_alive=servers.KEEP_ALIVE_SECONDS,
    )
    AnnouncingServer(config).run()


if __name__ == "__main__":
    main()
