"""`coordinator`: serve CoordinatorService for one fleet until SIGTERM or SIGINT, announcing
its address as one JSON line once it listens. The signals are the process's `stop_signals`
(taken by `cli.main` first): at any moment they stop it gracefully and quietly, exit 0
(SIGTERM) or 130 (SIGINT)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from rollout_checkpoint.client.cli.console import CliError, ExitCode
from rollout_checkpoint.client.fleet import FleetConfigError, load_fleet_file
from rollout_checkpoint.server.core.rpc.health_listener import HealthBindError
from rollout_checkpoint.server.core.rpc.tls import TlsFilesError, server_credentials
from rollout_checkpoint.server.core.stop_signals import PROCESS

if TYPE_CHECKING:
    from rollout_checkpoint.client.coordinator.supervisor import SupervisorSettings


async def coordinator_verb(args: argparse.Namespace) -> int:
    """Serve the coordinator until SIGTERM or SIGINT; `CliError` (exit 8) when its address is taken, `FleetConfigError` for a missing fleet file."""
    from rollout_checkpoint.client.coordinator.http_listener import HttpBindError
    from rollout_checkpoint.client.coordinator.service import Coordinator

    if not args.fleet.is_file():
        raise FleetConfigError(f"{args.fleet}: no such fleet file")
    spec = load_fleet_file(args.fleet)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        credentials = server_credentials(
            args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file
        )
    except TlsFilesError as error:
        raise CliError(ExitCode.USAGE, f"coordinator: {error}") from None
    supervise = supervisor_settings(args) if args.supervise else None
    if supervise is not None and spec.checkpoint_root is None:
        raise FleetConfigError(f"{args.fleet}: --supervise needs checkpoint_root in the fleet file")
    coordinator = Coordinator(
        spec,
        args.grpc_address,
        reflection_enabled=args.reflection,
        supervise=supervise,
        credentials=credentials,
        health_address=args.health_address,
        http_address=args.http_address,
    )

    def announce(server: Coordinator) -> None:
        host = args.grpc_address.rsplit(":", 1)[0]
        line: dict[str, object] = {
            "grpc": f"{host}:{server.port}",
            "pid": os.getpid(),
            "members": len(spec.members),
        }
        if server.health_listener is not None:
            line["health"] = server.health_listener.bound_address
        if server.http_listener is not None:
            line["http"] = server.http_listener.bound_address
        print(json.dumps(line), flush=True)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    with PROCESS.stopping_with(lambda signum: loop.call_soon_threadsafe(stopping.set)):
        try:
            await coordinator.serve_until(stopping, on_started=announce)
        except RuntimeError as error:
            if "bind" not in str(error).lower():
                raise
            address = (
                error.address
                if isinstance(error, (HealthBindError, HttpBindError))
                else args.grpc_address
            )
            raise CliError(
                ExitCode.ADDRESS_IN_USE, f"cannot listen on {address}: in use or invalid"
            ) from None
    return ExitCode.OK


def supervisor_settings(args: argparse.Namespace) -> SupervisorSettings:
    """The `--supervise` flags as settings."""
    from rollout_checkpoint.client.coordinator.supervisor import (
        PAUSE_AT_VARIABLE,
        RestartStrategy,
        SupervisorSettings,
        pause_at,
    )
    from rollout_checkpoint.client.recovery import no_pause

    point = os.environ.get(PAUSE_AT_VARIABLE)
    return SupervisorSettings(
        checkpoint_every=args.checkpoint_every or None,
        checkpoint_seconds=args.checkpoint_deadline,
        recovery_seconds=args.recovery_deadline,
        strategy=RestartStrategy(
            max_tries=args.max_recoveries,
            window_seconds=args.recovery_window,
            backoff_seconds=args.recovery_backoff,
        ),
        step=pause_at(point) if point else no_pause,
    )
