"""`rollout-checkpoint participant RPC --address HOST:PORT`: one participant's control plane
by hand, the same typed RPCs a controller uses, printed as JSON (one object per line).

The token comes from `--token-file`, else the `ROLLOUT_CHECKPOINT_TOKEN` variable (never from a
flag, so it does not end up in shell history or `ps`). Errors end through the fleet verbs'
classifier, so a refusal, an unreachable sidecar or a bad token has the fleet verbs' codes."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from rollout_checkpoint.client.cli.console import (
    CliError,
    ExitCode,
    HelpFormatter,
    epilog,
    exit_code_table,
)
from rollout_checkpoint.client.cli.names import EPISODE_FORMAT, TOKEN_ENV, episode_arg
from rollout_checkpoint.client.participant import ParticipantClient

_RPCS: dict[str, tuple[str, str, bool]] = {
    # name: (help, example arguments, takes a checkpoint id)
    "describe": ("GetParticipant: kind, instance, boot id, facts", "", False),
    "status": ("GetStatus: state, admission, readiness, lease (every field)", "", False),
    "episodes": ("ListEpisodes (all pages), one JSON line each", "", False),
    "prepare": ("Prepare: print each progress message as it arrives", " ckpt-1", True),
    "renew": ("Renew the lease", " ckpt-1", True),
    "commit": ("Commit into a directory", " ckpt-1 --dir /tmp/ckpt-1", True),
    "restore": (
        "Restore from a directory",
        " restore-1 --dir /tmp/ckpt-1 --episode r-a1",
        True,
    ),
    "resume": ("Resume (or abort) a checkpoint or a restore", " ckpt-1", True),
    "retire": ("Retire attempts", " cleanup-1 r-a1", True),
    "forget": ("Forget retired rollouts", " cleanup-1 r", True),
}

_CHECKPOINT_ID_NOTES = {
    "restore": "checkpoint_id: this restore's own id (resume it later), not the id of the "
    "checkpoint in --dir.",
    "resume": "checkpoint_id: the id of the checkpoint or restore to end.",
}


def add_participant_verbs(verbs: Any) -> None:
    """Register `participant RPC` on the CLI's subparsers (`verbs`, what `add_subparsers`
    returned): one sub-verb per ParticipantService RPC."""
    participant = verbs.add_parser(
        "participant",
        help="drive one participant's ParticipantService",
        description="The typed RPCs of one participant, printed as JSON (one object per line).",
        epilog=exit_code_table(),
        formatter_class=HelpFormatter,
    )
    rpcs = participant.add_subparsers(dest="rpc", required=True, metavar="RPC")
    for name, (help_text, example, checkpoint) in _RPCS.items():
        notes = (
            [_CHECKPOINT_ID_NOTES.get(name, "checkpoint_id: the checkpoint's id.")]
            if checkpoint
            else []
        )
        if name in ("commit", "restore", "retire"):
            notes.append(EPISODE_FORMAT)
        sub = rpcs.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=epilog(
                f"rollout-checkpoint participant {name} --address 127.0.0.1:9001{example}", *notes
            ),
            formatter_class=HelpFormatter,
        )
        sub.add_argument("--address", required=True, help="the participant's sidecar HOST:PORT")
        sub.add_argument(
            "--token-file", type=Path, help=f"file holding the bearer token (else ${TOKEN_ENV})"
        )
        if not checkpoint:
            continue
        sub.add_argument("checkpoint_id", help="see below")
        sub.add_argument(
            "--timeout",
            type=float,
            default=60.0,
            help="seconds from now to the request's deadline",
        )
        if name in ("commit", "restore"):
            sub.add_argument("--dir", required=True, help="absolute checkpoint directory")
            sub.add_argument(
                "--episode",
                action="append",
                type=episode_arg,
                default=None,
                help="an episode in scope (repeat)",
            )
        if name == "commit":
            sub.add_argument(
                "--empty-scope",
                action="store_true",
                help="commit with an empty scope (not unscoped)",
            )
        if name == "restore":
            sub.add_argument(
                "--rejoin",
                action="store_true",
                help="restore a process that has served (a survivor of a crashed fleet): it "
                "first retires every episode it holds and forgets having served",
            )
        if name == "retire":
            sub.add_argument(
                "episodes", nargs="+", type=episode_arg, help="rollout ids or capture keys"
            )
        if name == "forget":
            sub.add_argument("rollout_ids", nargs="+", help="rollout ids")


def _token(path: Path | None) -> str:
    token = path.read_text().strip() if path is not None else os.environ.get(TOKEN_ENV, "")
    if not token:
        raise CliError(ExitCode.USAGE, f"no token: pass --token-file or set {TOKEN_ENV}")
    return token


def _print(message: Message) -> None:
    """One message as one JSON line, with every field (false, zero and empty ones too: an
    operator reading `admission_open` must see it when it is false)."""
    print(
        json.dumps(
            MessageToDict(
                message,
                preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True,
            ),
            sort_keys=True,
        ),
        flush=True,
    )


async def participant_verb(args: argparse.Namespace) -> int:
    """Run one `participant RPC`; the exit code (3 for a prepare that did not become ready).

    Raises what the client raises (`ControlError`, `OSError` of a token file), for
    `errors.classify`; a missing token is `CliError` (exit 2)."""
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
    return ExitCode.OK


async def _checkpoint_rpc(
    client: ParticipantClient, args: argparse.Namespace, deadline: float
) -> int:
    checkpoint_id: str = args.checkpoint_id
    if args.rpc == "prepare":
        final = await client.prepare_until_final(checkpoint_id, deadline, on_update=_print)
        return ExitCode.OK if final.readiness.ready else ExitCode.NOT_PREPARED
    if args.rpc == "renew":
        _print(await client.renew(checkpoint_id, deadline))
    elif args.rpc == "commit":
        scope = [] if args.empty_scope else args.episode
        _print(await client.commit(checkpoint_id, deadline, args.dir, scope))
    elif args.rpc == "restore":
        _print(
            await client.restore(
                checkpoint_id, deadline, args.dir, args.episode or [], rejoin=args.rejoin
            )
        )
    elif args.rpc == "resume":
        _print(await client.resume(checkpoint_id, deadline))
    elif args.rpc == "retire":
        _print(await client.retire(checkpoint_id, deadline, args.episodes))
    elif args.rpc == "forget":
        _print(await client.forget(checkpoint_id, deadline, args.rollout_ids))
    return ExitCode.OK
