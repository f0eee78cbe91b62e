"""The policy model's command line (`python -m rollout_checkpoint.examples.policy_model`, and its
flags in `rollout-checkpoint serve policy_model`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from rollout_checkpoint.server.core.keep_alive import SERVER_IDLE_SECONDS
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from ..serve.arguments import add_file_arguments
from .config import InputFileError, PolicyModelConfig
from .policy import DEFAULT_MODEL
from .recording import Recording
from .server import PolicyModelServer
from .task_file import load_task_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The policy model's own flags (for `rollout-checkpoint serve policy_model`)."""
    parser.add_argument(
        "--latency",
        type=float,
        default=0.05,
        help="seconds of simulated generation per call (default 0.05)",
    )
    parser.add_argument(
        "--token-latency",
        type=float,
        default=0.0,
        help="seconds per generated token on top of --latency (default 0: all at once)",
    )
    parser.add_argument(
        "--upstream",
        default=None,
        help="proxy a real OpenAI-compatible server at this base URL instead of scripting",
    )
    parser.add_argument(
        "--upstream-continuation",
        choices=["none", "vllm"],
        default="none",
        help="how the upstream continues a generation cut (vllm: continue_final_message)",
    )
    parser.add_argument(
        "--upstream-timeout", type=float, default=600.0, help="seconds per upstream call"
    )
    parser.add_argument(
        "--model-name", default=DEFAULT_MODEL, help="the reply's model when a request names none"
    )
    parser.add_argument(
        "--fall-one-in",
        type=int,
        default=4,
        help="one (task, rollout) pair in N falls for the injection (0: never; default 4)",
    )


def file_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `PolicyModelConfig` fields the file flags name (`tasks`, `recording` and its
    `replay_latency`), loaded now,
    before anything listens; `InputFileError` (one line) for a file that cannot be used or a
    flag that does not apply."""
    options: dict[str, Any] = {}
    tasks = getattr(args, "tasks", None)
    if tasks is not None:
        if getattr(args, "upstream", None) is not None:
            raise InputFileError("--tasks applies to the scripted model, not to --upstream")
        options["tasks"] = load_task_file(tasks)
    record, replay = getattr(args, "record", None), getattr(args, "replay", None)
    replay_latency = getattr(args, "replay_latency", None) or 0.0
    if not replay_latency >= 0:
        raise InputFileError("--replay-latency is a number of seconds, 0 or more")
    if replay_latency and replay is None:
        raise InputFileError("--replay-latency applies to --replay only")
    if record is not None:
        options["recording"] = Recording.load(record, "record")
    elif replay is not None:
        options["recording"] = Recording.load(replay, "replay")
        options["replay_latency"] = replay_latency
    return options


def build_server(
    args: argparse.Namespace, checkpoint: CheckpointSettings | None = None
) -> PolicyModelServer:
    """A server from parsed flags. `checkpoint` None: built from the common serve flags
    (`--no-checkpoint`, `--token`, `--grpc-address`, `--start-closed`, `--instance`).
    `InputFileError` for a file flag that cannot be used (`file_options`)."""
    instance = getattr(args, "instance", None) or "policy_model"
    if checkpoint is None and not getattr(args, "no_checkpoint", False):
        overrides: dict[str, Any] = {
            "enabled": True,
            "instance": instance,
            "start_closed": bool(getattr(args, "start_closed", False)),
        }
        if getattr(args, "token", None) is not None:
            overrides["token"] = args.token
        if getattr(args, "grpc_address", None) is not None:
            overrides["grpc_address"] = args.grpc_address
        checkpoint = CheckpointSettings(**overrides)
    return PolicyModelServer(
        PolicyModelConfig(
            instance=instance,
            checkpoint=checkpoint,
            latency=getattr(args, "latency", 0.05),
            token_latency=getattr(args, "token_latency", 0.0),
            upstream=getattr(args, "upstream", None),
            upstream_api_key=os.environ.get("ROLLOUT_CHECKPOINT_UPSTREAM_API_KEY") or None,
            upstream_continuation=getattr(args, "upstream_continuation", "none"),
            upstream_timeout=getattr(args, "upstream_timeout", 600.0),
            model_name=getattr(args, "model_name", DEFAULT_MODEL),
            fall_one_in=getattr(args, "fall_one_in", 4),
            **file_options(args),
        )
    )


def main(argv: list[str] | None = None) -> None:
    """Serve the policy model as its own process; print one JSON line once it listens
    (`http`, `grpc`, `instance`, `kind: "model"`, `pid`)."""
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m rollout_checkpoint.examples.policy_model",
        description="The scripted policy model (or a proxy to a real one) with its sidecar.",
    )
    parser.add_argument("--http-address", default="127.0.0.1:0", help="HOST:PORT (0: free port)")
    parser.add_argument("--grpc-address", default=None, help="the sidecar's HOST:PORT")
    parser.add_argument(
        "--token", default=None, help="control token (else $ROLLOUT_CHECKPOINT_TOKEN)"
    )
    parser.add_argument("--no-checkpoint", action="store_true", help="run without checkpointing")
    parser.add_argument("--instance", default=None, help="instance name (default policy_model)")
    parser.add_argument("--start-closed", action="store_true", help="start with admission closed")
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    add_arguments(parser)
    add_file_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        server = build_server(args)
    except InputFileError as error:
        print(f"{parser.prog}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    app = server.build_app()
    host, _, port = args.http_address.rpartition(":")
    host = host.strip("[]")

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            bound = self.servers[0].sockets[0].getsockname()
            announcement = {
                "http": f"{host}:{bound[1]}",
                "grpc": server.runtime.address if server.runtime is not None else None,
                "instance": server.instance,
                "kind": "model",
                "pid": os.getpid(),
            }
            print(json.dumps(announcement), flush=True)

    config = uvicorn.Config(
        app,
        host=host,
        port=int(port),
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=SERVER_IDLE_SECONDS,
    )
    AnnouncingServer(config).run()
