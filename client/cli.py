"""The `rollout-checkpoint` command line.

`rollout-checkpoint participant VERB --address HOST:PORT` drives one participant's control
plane by hand: the same typed RPCs a controller uses, printed as JSON. The token comes from
`--token-file`, else the `ROLLOUT_CHECKPOINT_TOKEN` variable (never from a flag, so it does not
end up in shell history or `ps`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from rollout_checkpoint.client.collect import add_collect_verb, run_collect
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet_cli import add_fleet_verbs, is_fleet_command
from rollout_checkpoint.client.fleet_cli import run as run_fleet_command
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId

TOKEN_ENV = "ROLLOUT_CHECKPOINT_TOKEN"


def _episode(text: str) -> EpisodeId:
    """`rollout_id` or a capture key such as `r-a2`."""
    try:
        return EpisodeId.from_capture_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-checkpoint", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="command", required=True)
    verbs.add_parser(
        "demo",
        help="checkpoint a live fleet mid-flight, SIGKILL it, restore, continue; demo --help",
    )
    verbs.add_parser(
        "serve",
        help="run an example resources server (weather, counter, prompt_injection); serve --help",
    )
    add_fleet_verbs(verbs)
    add_collect_verb(verbs)
    participant = verbs.add_parser("participant", help="drive one participant's ParticipantService")
    rpcs = participant.add_subparsers(dest="rpc", required=True)

    def rpc(name: str, help_text: str, *, checkpoint: bool = True) -> argparse.ArgumentParser:
        sub = rpcs.add_parser(name, help=help_text)
        sub.add_argument("--address", required=True, help="the participant's sidecar HOST:PORT")
        sub.add_argument(
            "--token-file", type=Path, help=f"file holding the bearer token (else ${TOKEN_ENV})"
        )
        if checkpoint:
            sub.add_argument("checkpoint_id")
            sub.add_argument(
                "--timeout",
                type=float,
                default=60.0,
                help="seconds from now to the request's deadline",
            )
        return sub

    rpc("describe", "GetParticipant", checkpoint=False)
    rpc("status", "GetStatus", checkpoint=False)
    rpc("episodes", "ListEpisodes (all pages)", checkpoint=False)
    rpc("prepare", "Prepare: print each progress message as it arrives")
    rpc("renew", "Renew the lease")
    for name, help_text in (
        ("commit", "Commit into a directory"),
        ("restore", "Restore from a directory"),
    ):
        sub = rpc(name, help_text)
        sub.add_argument("--dir", required=True, help="absolute checkpoint directory")
        sub.add_argument(
            "--episode",
            action="append",
            type=_episode,
            default=None,
            help="an episode in scope (repeat)",
        )
        if name == "commit":
            sub.add_argument(
                "--empty-scope",
                action="store_true",
                help="commit with an empty scope (not unscoped)",
            )
    rpc("resume", "Resume (or abort) a checkpoint")
    sub = rpc("retire", "Retire attempts")
    sub.add_argument("episodes", nargs="+", type=_episode)
    sub = rpc("forget", "Forget retired rollouts")
    sub.add_argument("rollout_ids", nargs="+")
    return parser


def _token(path: Path | None) -> str:
    if path is not None:
        return path.read_text().strip()
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"rollout-checkpoint: no token: pass --token-file or set {TOKEN_ENV}")
    return token


def _print(message: Message) -> None:
    print(
        json.dumps(MessageToDict(message, preserving_proto_field_name=True), sort_keys=True),
        flush=True,
    )


async def _participant(args: argparse.Namespace) -> int:
    async with ParticipantClient(args.address, _token(args.token_file)) as client:
        if args.rpc == "describe":
            _print(await client.get_participant())
        elif args.rpc == "status":
            _print(await client.get_status())
        elif args.rpc == "episodes":
            for episode in await client.all_episodes():
                _print(episode)
        else:
            return await _checkpoint_rpc(client, args, time.time() + args.timeout)
    return 0


async def _checkpoint_rpc(
    client: ParticipantClient, args: argparse.Namespace, deadline: float
) -> int:
    checkpoint_id: str = args.checkpoint_id
    if args.rpc == "prepare":
        final = await client.prepare_until_final(checkpoint_id, deadline, on_update=_print)
        return 0 if final.readiness.ready else 3
    if args.rpc == "renew":
        _print(await client.renew(checkpoint_id, deadline))
    elif args.rpc == "commit":
        scope = [] if args.empty_scope else args.episode
        _print(await client.commit(checkpoint_id, deadline, args.dir, scope))
    elif args.rpc == "restore":
        _print(await client.restore(checkpoint_id, deadline, args.dir, args.episode or []))
    elif args.rpc == "resume":
        _print(await client.resume(checkpoint_id, deadline))
    elif args.rpc == "retire":
        _print(await client.retire(checkpoint_id, deadline, args.episodes))
    elif args.rpc == "forget":
        _print(await client.forget(checkpoint_id, deadline, args.rollout_ids))
    return 0


def _serve(args: list[str]) -> int:
    """Replace this process with the server's (`python -m rollout_checkpoint.examples.serve`).

    The CLI never imports the participant runtime; exec keeps signals going straight to the
    server, so SIGTERM shuts it down gracefully."""
    return _exec_module("rollout_checkpoint.examples.serve", args)


def _exec_module(module: str, args: list[str]) -> int:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])
    return 0  # pragma: no cover - execv does not return


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["serve"]:
        return _serve(arguments[1:])
    if arguments[:1] == ["demo"]:
        return _exec_module("rollout_checkpoint.examples.demo", arguments[1:])
    args = _parser().parse_args(arguments)
    if args.command == "collect":
        return run_collect(args, ["rollout-checkpoint", *arguments])
    if is_fleet_command(args.command):
        return run_fleet_command(args)
    try:
        return asyncio.run(_participant(args))
    except ControlError as error:
        detail = {
            "code": error.code.name,
            "reason": error.reason,
            "message": error.message,
            "metadata": error.metadata,
        }
        print(json.dumps({"error": detail}, sort_keys=True), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
