"""`serve`'s command line, and the checks that refuse a bad one before anything starts.

Every refusal is one line on stderr and a documented exit code (2 for usage, 8 for an address
that is taken or invalid), given before the server binds its port: a server that started and
then failed on its own flags would look to an orchestrator like a crash worth retrying.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from rollout_checkpoint.client.cli.console import ExitCode, HelpFormatter, epilog
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .kinds import KINDS, NEMO_GYM_KINDS, NOT_FOR_NEMO_GYM, is_user_app

SUMMARY = (
    "Run one fleet server (an example, one of NeMo Gym's own, or your own as MODULE:ATTRIBUTE) "
    "with its checkpoint sidecar"
)
"""The first line of `--help` (and of the package's docstring)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rollout-checkpoint serve",
        description=SUMMARY
        + ". Prints one JSON line (http, grpc, instance, kind, pid; health with "
        "--health-address) once both listen.",
        epilog=epilog(
            "ROLLOUT_CHECKPOINT_TOKEN=change-me rollout-checkpoint serve counter "
            "--http-address 127.0.0.1:8001 --grpc-address 127.0.0.1:9001",
            "servers: " + ", ".join(f"{name} ({kind})" for name, kind in sorted(KINDS.items())),
            "nemo-gym:<server>: NeMo Gym's own server, from the nemo-gym installed in this "
            "environment (tested: 0.4.0 on Python 3.12); --instance defaults to ng_run's.",
            "MODULE:ATTRIBUTE: your own server, MODULE imported with the working directory "
            "first on sys.path. ATTRIBUTE names a ResourcesServer subclass (built from these "
            "flags; --workers N imports it in each worker) or a function taking the "
            "CheckpointSettings made from these flags (None with --no-checkpoint) and "
            "returning the Starlette/FastAPI app it called install_checkpointing on with "
            "them (one process). Not an app built at import: its settings would ignore these "
            "flags. --instance defaults to MODULE.ATTRIBUTE.",
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "server",
        metavar="SERVER",
        help="which server to run: one of the servers below, or MODULE:ATTRIBUTE (yours)",
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
        "instance name, which also names its session cookie and secret; MODULE:ATTRIBUTE: "
        "MODULE.ATTRIBUTE)",
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
    add_file_arguments(model)
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
        help="the fleet name the agent uses for a task's tools (a task's own resources_server wins)",
    )
    args = parser.parse_args(argv)
    if args.server not in KINDS and not is_user_app(args.server):
        fail(
            EXIT_USAGE,
            f"unknown server {args.server!r}: one of {', '.join(sorted(KINDS))}, "
            "or MODULE:ATTRIBUTE (your own)",
        )
    return args


def add_file_arguments(parser: argparse._ActionsContainer) -> None:
    """The flags naming the policy model's files: `serve policy_model`'s and the policy model's
    own (`python -m rollout_checkpoint.examples.policy_model`). Defined here, not in the
    policy model's package, so that `serve counter` does not import the policy model."""
    parser.add_argument(
        "--tasks",
        type=Path,
        default=None,
        metavar="FILE",
        help="the tasks the scripted model follows (JSON lines, the file collect's --input "
        "takes; default: the shipped prompt-injection tasks)",
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="FILE",
        help="append every reply to this recording (JSON lines), keyed by rollout and "
        "request; a call it already holds is answered from it",
    )
    modes.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="FILE",
        help="answer every call from this recording; a call it does not hold gets 409 "
        "not_in_recording",
    )
    parser.add_argument(
        "--replay-latency",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds every replayed answer waits before it is sent (default 0), so that "
        "rollouts replayed are still in flight when a checkpoint or a fault comes",
    )


def split_address(address: str) -> tuple[str, int]:
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
        host, port = split_address(address)
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


POLICY_MODEL_FILES = {
    "tasks": "--tasks",
    "record": "--record",
    "replay": "--replay",
    "replay_latency": "--replay-latency",
}
"""The policy model's file flags: refused for any other server rather than ignored (a
recording the operator asked for and never got would surface only when replayed)."""


def refuse_inapplicable_flags(args: argparse.Namespace, builds_its_own_app: bool) -> None:
    """Exit 2 with one line for a flag the chosen server cannot honour (`builds_its_own_app`:
    a user's factory, which configures its resources server itself, if it has one)."""
    if args.server != "policy_model":
        for attribute, flag in POLICY_MODEL_FILES.items():
            if getattr(args, attribute) is not None:
                fail(EXIT_USAGE, f"{flag} applies to policy_model only, not to {args.server}")
    if args.server in NEMO_GYM_KINDS or builds_its_own_app:
        for attribute, flag in NOT_FOR_NEMO_GYM.items():
            if getattr(args, attribute):
                fail(EXIT_USAGE, f"{flag} does not apply to {args.server}")
