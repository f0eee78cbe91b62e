"""The demo's fleet as local processes: start it callee-first, stop it, kill it callers-first.

Each server is a real `serve` process in its own process group with its sidecar on a free
loopback port below the ephemeral range (`client/fleet/ports.py`), announced by one JSON line:
the demo drives the same processes an operator would run, so a SIGKILL here is the crash it
claims to survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_checkpoint.client import FleetSpec, MemberSpec
from rollout_checkpoint.client.fleet.ports import address_was_taken, restartable_addresses

from .options import Options


@dataclass
class Server:
    name: str
    kind: str
    process: subprocess.Popen[str]
    http: str
    grpc: str
    log: Path
    args: list[str] = field(default_factory=list)
    """What it was started with (`serve` arguments): a replacement reuses them."""


ANNOUNCE_TIMEOUT_SECONDS = 60.0
"""How long a fleet server may take to print its announcement line."""


@dataclass
class FleetProcesses:
    """One generation of the fleet: five processes with sidecars on free loopback ports."""

    label: str
    servers: dict[str, Server] = field(default_factory=dict)

    def spec(self, token: str) -> FleetSpec:
        members = tuple(MemberSpec(s.name, s.grpc) for s in self.servers.values())
        return FleetSpec(members=members, token=token)

    def url(self, name: str) -> str:
        return f"http://{self.servers[name].http}"

    def kill(self) -> None:
        """SIGKILL every server, callers first, each dead before the next is killed.

        Callees started first, so the reverse of the start order kills the environment before
        the agent and the agent before its callees: a caller that outlived its callee would log
        a traceback for the connection it lost, which no real crash of the whole fleet shows."""
        for server in reversed(list(self.servers.values())):
            signal_group(server.process, signal.SIGKILL)
            server.process.wait(timeout=30)

    def stop(self) -> None:
        for server in self.servers.values():
            signal_group(server.process, signal.SIGTERM)
        for server in self.servers.values():
            try:
                server.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                signal_group(server.process, signal.SIGKILL)
                server.process.wait(timeout=10)


def signal_group(process: subprocess.Popen[str], signum: int) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)


def serve_options(token: str, *, start_closed: bool) -> list[str]:
    """The options every fleet server is started with.

    The token is passed as `--token=VALUE`: a random urlsafe token starts with `-` one time in
    64, and argparse would take `--token -x…` for a missing value followed by an option."""
    return [f"--token={token}", "--log-level", "info"] + (
        ["--start-closed"] if start_closed else []
    )


async def start_fleet(
    label: str, logs: Path, token: str, options: Options, *, start_closed: bool
) -> FleetProcesses:
    """Start the fleet callee-first: every server's address is known before its caller starts."""
    fleet = FleetProcesses(label)
    common = serve_options(token, start_closed=start_closed)
    # Several workers per resources and environment server: still one participant each.
    workers = ["--workers", str(options.workers)] if options.workers > 1 else []
    first = await asyncio.gather(
        _start(
            fleet, logs, "prompt_injection", "resources", ["prompt_injection", *workers, *common]
        ),
        _start(fleet, logs, "counter", "resources", ["counter", *workers, *common]),
        _start(
            fleet,
            logs,
            "policy_model",
            "model",
            ["policy_model", "--latency", str(options.latency), *common],
        ),
    )
    del first
    await _start(
        fleet,
        logs,
        "agent",
        "agent",
        [
            "agent",
            "--model-url",
            fleet.url("policy_model"),
            "--resources",
            f"prompt_injection={fleet.url('prompt_injection')}",
            "--resources",
            f"counter={fleet.url('counter')}",
            *workers,
            *common,
        ],
    )
    await _start(
        fleet,
        logs,
        "environment",
        "environment",
        ["environment", "--agent-url", fleet.url("agent"), *workers, *common],
    )
    return fleet


ADDRESS_TRIES = 5
"""Fresh addresses a server's first start gets when another process took the ones chosen."""


async def _start(fleet: FleetProcesses, logs: Path, name: str, kind: str, args: list[str]) -> None:
    """Start one server on addresses below the ephemeral range (`client/fleet/ports.py`): a
    replacement after a SIGKILL must be able to listen on them again. Chosen free, they can
    still be taken before the server binds them (another process choosing at that moment):
    then the server starts again on fresh ones."""
    for attempt in range(1, ADDRESS_TRIES + 1):
        http, grpc = restartable_addresses(2)
        addresses = ["--http-address", http, "--grpc-address", grpc]
        try:
            fleet.servers[name] = await asyncio.to_thread(
                launch_server, fleet.label, logs, name, kind, [*args, *addresses]
            )
            return
        except AddressTaken:
            if attempt == ADDRESS_TRIES:
                raise


class AddressTaken(RuntimeError):
    """A server exited before it announced itself because its address was taken."""


def launch_server(label: str, logs: Path, name: str, kind: str, args: list[str]) -> Server:
    """Start one server in its own process group and read the line it prints once it listens."""
    log = logs / f"{label}-{name}.log"
    command = [sys.executable, "-m", "rollout_checkpoint.examples.serve", *args]
    process, announced = start_announcing(command, name, log)
    return Server(name, kind, process, announced["http"], announced["grpc"], log, args)


def start_announcing(
    command: list[str], name: str, log: Path
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start `command` in its own process group (stderr to `log`) and read the JSON line it
    prints once it listens. Bounded: a process that never announces itself must fail the
    demo, not hang it."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
            env=dict(os.environ, GRPC_VERBOSITY="ERROR"),
        )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], ANNOUNCE_TIMEOUT_SECONDS)
    line = process.stdout.readline() if ready else ""
    if not line:
        signal_group(process, signal.SIGKILL)
        code = process.wait()
        failure = AddressTaken if address_was_taken(code, _read(log)) else RuntimeError
        raise failure(
            f"{name} did not start within {ANNOUNCE_TIMEOUT_SECONDS:g} s (exit {code}); see {log}"
        )
    announced: dict[str, Any] = json.loads(line)
    return process, announced


def _read(log: Path) -> str:
    try:
        return log.read_text(errors="replace")
    except OSError:
        return ""
