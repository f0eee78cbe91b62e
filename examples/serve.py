"""Run one example resources server with its checkpoint sidecar, as its own process.

    python -m rollout_checkpoint.examples.serve counter --http-address 127.0.0.1:0

Once HTTP and gRPC both listen it prints one JSON line to stdout (`http`, `grpc`, `instance`,
`kind`, `pid`) so scripts and tests can find it. SIGTERM shuts it down gracefully: health goes
NOT_SERVING at once, HTTP drains, then the sidecar stops.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Any

import uvicorn

from rollout_checkpoint.server.resources import ResourcesServer, ResourcesServerConfig
from rollout_checkpoint.server.settings import CheckpointSettings

SERVERS = {
    "weather": "rollout_checkpoint.examples.weather:WeatherServer",
    "counter": "rollout_checkpoint.examples.counter:CounterServer",
    "prompt_injection": "rollout_checkpoint.examples.prompt_injection:PromptInjectionServer",
}


def server_class(name: str) -> type[ResourcesServer]:
    module, _, attribute = SERVERS[name].partition(":")
    cls: type[ResourcesServer] = getattr(importlib.import_module(module), attribute)
    return cls


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rollout-checkpoint serve", description=__doc__.splitlines()[0]
    )
    parser.add_argument("server", choices=sorted(SERVERS))
    parser.add_argument(
        "--http-address", default="127.0.0.1:0", help="HOST:PORT (port 0 picks a free one)"
    )
    parser.add_argument(
        "--grpc-address", default=None, help="the sidecar's HOST:PORT (default 127.0.0.1:0)"
    )
    parser.add_argument(
        "--token", default=None, help="control token (else $ROLLOUT_CHECKPOINT_TOKEN)"
    )
    parser.add_argument("--no-checkpoint", action="store_true", help="run without checkpointing")
    parser.add_argument("--mcp", action="store_true", help="also serve the tools over MCP at /mcp")
    parser.add_argument(
        "--instance", default=None, help="instance name (default: the server's name)"
    )
    parser.add_argument(
        "--session-secret",
        default=None,
        help="cookie secret (else $ROLLOUT_CHECKPOINT_SESSION_SECRET, else derived)",
    )
    parser.add_argument(
        "--start-closed",
        action="store_true",
        help="start with admission closed (a replacement process)",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    return parser.parse_args(argv)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    instance = args.instance or args.server
    checkpoint: CheckpointSettings | None = None
    if not args.no_checkpoint:
        overrides: dict[str, Any] = {
            "enabled": True,
            "instance": instance,
            "start_closed": args.start_closed,
        }
        if args.token is not None:
            overrides["token"] = args.token
        if args.grpc_address is not None:
            overrides["grpc_address"] = args.grpc_address
        checkpoint = CheckpointSettings(**overrides)
    config = ResourcesServerConfig(
        instance=instance,
        checkpoint=checkpoint,
        session_secret=args.session_secret
        or os.environ.get("ROLLOUT_CHECKPOINT_SESSION_SECRET")
        or None,
        expose_tools_over_mcp=True if args.mcp else None,
    )
    server = server_class(args.server)(config)
    app = server.build_app()
    host, port = _split(args.http_address)

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            bound = self.servers[0].sockets[0].getsockname()
            announcement = {
                "http": f"{host}:{bound[1]}",
                "grpc": server.runtime.address if server.runtime is not None else None,
                "instance": instance,
                "kind": "resources",
                "pid": os.getpid(),
            }
            print(json.dumps(announcement), flush=True)

    uvicorn_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    AnnouncingServer(uvicorn_config).run()


if __name__ == "__main__":
    main()
