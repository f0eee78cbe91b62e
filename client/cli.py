"""The `rollout-checkpoint` command line.

`rollout-checkpoint participant VERB --address HOST:PORT` drives one participant's control
plane by hand: the same typed RPCs a controller uses, printed as JSON. The token comes from
`--token-file`, else the `ROLLOUT_CHECKPOINT_TOKEN` variable (never from a flag, so it does not
end up in shell history or `ps`).

Every verb ends through one handler (`console.run_verb`): errors are one line and an exit code
of the one table in `console.ExitCode`, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from rollout_checkpoint.client.collect import add_collect_verb, run_collect
from rollout_checkpoint.client.console import (
    CliError,
    ExitCode,
    HelpFormatter,
    epilog,
    exit_code_table,
    run_async,
    run_verb,
)
from rollout_checkpoint.client.fleet_cli import (
    EPISODE_FORMAT,
    add_fleet_verbs,
    classify,
    is_fleet_command,
)
from rollout_checkpoint.client.fleet_cli import run as run_fleet_command
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId

TOKEN_ENV = "ROLLOUT_CHECKPOINT_TOKEN"
SERVED_KINDS = (
    ("weather", "resources, stateless"),
    ("counter", "resources, exported"),
    ("prompt_injection", "resources, exported, verify wait"),
    ("policy_model", "model"),
    ("agent", "agent"),
    ("environment", "environment"),
)
"""What `serve` runs (examples/serve.py's KINDS; a test keeps the two equal). Listed here
because the CLI never imports the participant runtime."""


def _version() -> str:
    try:
        return package_version("rollout-checkpoint")
    except PackageNotFoundError:  # pragma: no cover - run from a tree that was not installed
        return "unknown"


def _episode(text: str) -> EpisodeId:
    """`rollout_id` or a capture key such as `r-a2`."""
    try:
        return EpisodeId.from_capture_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


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


def _parser() -> argparse.ArgumentParser:
    kinds = ", ".join(f"{name} ({what})" for name, what in SERVED_KINDS)
    parser = argparse.ArgumentParser(
        prog="rollout-checkpoint",
        description="A gRPC control plane that checkpoints a fleet of RL rollout servers. "
        "`VERB --help` describes each verb.",
        epilog=f"serve runs: {kinds}.\n\n{exit_code_table()}",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    verbs = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    verbs.add_parser(
        "demo",
        help="checkpoint a live fleet mid-flight, SIGKILL it, restore, continue; demo --help",
    )
    verbs.add_parser(
        "serve",
        help=f"run an example fleet server with its sidecar: {', '.join(n for n, _ in SERVED_KINDS)}; "
        "serve --help",
    )
    add_fleet_verbs(verbs)
    add_collect_verb(verbs)
    collect = verbs.choices["collect"]
    collect.formatter_class = HelpFormatter
    collect.epilog = epilog(
        "rollout-checkpoint collect --fleet fleet.toml --entry-url http://127.0.0.1:8105 "
        "--input tasks.jsonl --output rollouts.jsonl --checkpoint-dir /tmp/eval-7"
    )
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
        if name == "retire":
            sub.add_argument(
                "episodes", nargs="+", type=_episode, help="rollout ids or capture keys"
            )
        if name == "forget":
            sub.add_argument("rollout_ids", nargs="+", help="rollout ids")
    return parser


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
        _print(await client.restore(checkpoint_id, deadline, args.dir, args.episode or []))
    elif args.rpc == "resume":
        _print(await client.resume(checkpoint_id, deadline))
    elif args.rpc == "retire":
        _print(await client.retire(checkpoint_id, deadline, args.episodes))
    elif args.rpc == "forget":
        _print(await client.forget(checkpoint_id, deadline, args.rollout_ids))
    return ExitCode.OK


def _exec_module(module: str, args: list[str]) -> int:
    """Replace this process with `python -m module args`.

    The CLI never imports the participant runtime; exec keeps signals going straight to the
    server, so SIGTERM shuts it down gracefully."""
    os.execv(sys.executable, [sys.executable, "-m", module, *args])
    return 0  # pragma: no cover - execv does not return


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["serve"]:
        return _exec_module("rollout_checkpoint.examples.serve", arguments[1:])
    if arguments[:1] == ["demo"]:
        return _exec_module("rollout_checkpoint.examples.demo", arguments[1:])
    args = _parser().parse_args(arguments)
    if args.command == "collect":
        return run_collect(args, ["rollout-checkpoint", *arguments])

    def verb() -> int:
        if is_fleet_command(args.command):
            return run_fleet_command(args)
        return run_async(lambda signals: _participant(args))

    return run_verb(verb, classify, as_json=bool(getattr(args, "json", False)))


if __name__ == "__main__":
    sys.exit(main())
