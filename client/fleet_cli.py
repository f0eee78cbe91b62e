"""Operators' verbs over a whole fleet (`--fleet FILE` or `--address HOST:PORT ...`).

Every verb ends through `console.run_verb` (one line or one JSON object for an error, the
exit codes of `console.ExitCode`). A verb that opens a checkpoint on the fleet (`prepare`,
`checkpoint`, `restore`) aborts it when SIGINT or SIGTERM stops it — Resume on every member in
reverse stage order — because a fleet left closed takes no traffic until its lease expires.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from grpc import aio
from grpc_health.v1 import health_pb2
from rich.live import Live
from rich.table import Table

from rollout_checkpoint.client import coordination
from rollout_checkpoint.client.checkpointing import (
    ABORT_SECONDS,
    CheckpointEvent,
    CheckpointOutcome,
    Phase,
    checkpoint,
    restore_published,
)
from rollout_checkpoint.client.collect.journal import DISPATCH_LOG
from rollout_checkpoint.client.console import (
    PROG,
    CliError,
    ExitCode,
    HelpFormatter,
    Interrupted,
    Output,
    Signals,
    add_output_flags,
    epilog,
    human_bytes,
    make_console,
    run_async,
    signal_name,
)
from rollout_checkpoint.client.coordination import DERIVE, FleetError, FleetProgress
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import (
    KIND_NAMES,
    DiscoveryError,
    Fleet,
    FleetConfigError,
    FleetSpec,
    MemberSpec,
    load_fleet_file,
)
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.client.publication import (
    CheckpointCorrupt,
    CheckpointRoot,
    PublicationError,
    verify_checkpoint,
)
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.layout import (
    FLEET_MANIFEST_NAME,
    LATEST_NAME,
    PARTICIPANTS_DIR,
)
from rollout_checkpoint.v1 import constants_pb2, types_pb2

TOKEN_ENV = "ROLLOUT_CHECKPOINT_TOKEN"
STATE_PREFIX = "PARTICIPANT_STATE_"
HEALTH_TIMEOUT_SECONDS = 5.0
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"


def _health_name(value: constants_pb2.HealthServiceName.ValueType) -> str:
    """The wire string of a `HealthServiceName` (its `wire_value` option in constants.proto)."""
    descriptor = constants_pb2.HealthServiceName.DESCRIPTOR.values_by_number[value]
    name: str = descriptor.GetOptions().Extensions[constants_pb2.wire_value]
    return name


READINESS_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS)
LIVENESS_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS)
SERVER_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_SERVER)

EPISODE_FORMAT = (
    "--episode: a rollout id (`r7`, attempt 1) or a capture key `<rollout_id>-a<attempt>` "
    "(`r7-a2`); repeat the flag for several."
)


def state_name(state: int, unknown: str) -> str:
    """A participant state's name in types.proto without its prefix (`IDLE`); `unknown` for
    UNSPECIFIED and for a value this version does not know."""
    if state == types_pb2.PARTICIPANT_STATE_UNSPECIFIED:
        return unknown
    try:
        return types_pb2.ParticipantState.Name(state).removeprefix(STATE_PREFIX)  # type: ignore[arg-type]
    except ValueError:
        return unknown


def rfc3339(seconds: float) -> str:
    """Epoch seconds as RFC 3339 UTC (`2026-12-01T12:00:00.000000Z`): one time format in
    every output of the CLI."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


FLEET_VERBS = (
    "status",
    "prepare",
    "commit",
    "checkpoint",
    "restore",
    "resume",
    "retire",
    "forget",
    "renew",
)

_VERBS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    # name: (one-line help, description, example, notes)
    "status": (
        "every member's state, admission, readiness and lease",
        "Show every member: state, active checkpoint, admission, readiness (the "
        f"`{READINESS_HEALTH}` health answer: may new traffic come here?), prepare blockers and "
        "lease. A member that cannot be reached is a row saying so (and the exit code is 5).",
        "rollout-checkpoint status --fleet fleet.toml",
        (),
    ),
    "prepare": (
        "prepare stage by stage, with live progress",
        "Prepare every member stage by stage (environment, model, agent, resources) and stop at "
        "the first stage not prepared by the deadline. Leaves the fleet prepared (closed) for a "
        "`commit`; interrupted, it resumes the fleet.",
        "rollout-checkpoint prepare --fleet fleet.toml ckpt-7",
        ("checkpoint_id: the id of the checkpoint this prepare opens.",),
    ),
    "commit": (
        "commit every member into a directory",
        "Commit every prepared member into one checkpoint directory (not published: use "
        "`checkpoint` for the whole sequence).",
        "rollout-checkpoint commit --fleet fleet.toml ckpt-7 --dir /checkpoints/ckpt-7",
        ("checkpoint_id: the id a previous `prepare` opened.", EPISODE_FORMAT),
    ),
    "checkpoint": (
        "prepare, commit, publish, resume",
        "Take and publish one checkpoint of the fleet: prepare with live progress, commit, "
        "publish (`checkpoint.json`, then `LATEST`), resume. Prints one summary line; `-v` or "
        "`--json` for the details. Interrupted (Ctrl-C, SIGTERM) it aborts: every member resumes.",
        "rollout-checkpoint checkpoint --fleet fleet.toml",
        (
            "checkpoint_id: the new checkpoint's id (default: ckpt-<UTC time>-<8 hex>).",
            EPISODE_FORMAT,
        ),
    ),
    "restore": (
        "restore a published checkpoint, all or nothing",
        "Verify a published checkpoint whole, then restore it into fresh processes started "
        "closed, all or nothing. The fleet stays closed until `resume` with the same id.",
        "rollout-checkpoint restore --fleet fleet.toml restore-1",
        (
            "checkpoint_id: the id of this restore operation (a new id, resumed later), not the "
            "published checkpoint: that is --source.",
            EPISODE_FORMAT,
        ),
    ),
    "resume": (
        "resume (or abort) on every member, in reverse stage order",
        "Reopen every member (Resume), in reverse stage order: ends a checkpoint, aborts one "
        "in progress, or opens a restored fleet.",
        "rollout-checkpoint resume --fleet fleet.toml restore-1",
        (
            "checkpoint_id: the id of the operation to end: a checkpoint's id, or the id given "
            "to `restore`.",
        ),
    ),
    "retire": (
        "retire attempts on every member, callers first",
        "Retire episode attempts everywhere (callers before callees); each also retires the "
        "earlier attempts of its rollout.",
        "rollout-checkpoint retire --fleet fleet.toml restore-1 r7-a2",
        ("checkpoint_id: in IDLE any valid id; while RESTORED the restore's id.", EPISODE_FORMAT),
    ),
    "forget": (
        "forget retired rollouts on every member, callers first",
        "Drop the retired-attempt marks of rollouts everywhere (callers before callees).",
        "rollout-checkpoint forget --fleet fleet.toml cleanup-1 r7",
        ("checkpoint_id: in IDLE any valid id.",),
    ),
    "renew": (
        "renew the lease on every member",
        "Renew the active checkpoint's lease everywhere; prints the earliest expiry (RFC 3339).",
        "rollout-checkpoint renew --fleet fleet.toml ckpt-7",
        ("checkpoint_id: the active checkpoint's id.",),
    ),
}


def add_fleet_verbs(verbs: Any) -> None:
    """Register the fleet verbs, `health`, `inspect` and `coordinator` on the CLI's
    subparsers."""

    def fleet_verb(name: str, *, checkpoint_id: bool = True) -> argparse.ArgumentParser:
        help_text, description, example, notes = _VERBS[name]
        sub: argparse.ArgumentParser = verbs.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=epilog(example, *notes),
            formatter_class=HelpFormatter,
        )
        where = sub.add_mutually_exclusive_group(required=True)
        where.add_argument("--fleet", type=Path, help="fleet file (TOML or YAML)")
        where.add_argument(
            "--address", action="append", help="a participant's sidecar HOST:PORT (repeat)"
        )
        sub.add_argument(
            "--token-file", type=Path, help=f"bearer token file (with --address; else ${TOKEN_ENV})"
        )
        add_output_flags(sub)
        if checkpoint_id:
            sub.add_argument(
                "checkpoint_id",
                nargs="?" if name == "checkpoint" else None,
                help="see below",
            )
            sub.add_argument(
                "--timeout",
                type=float,
                default=120.0,
                help="seconds from now to the operation's deadline",
            )
        return sub

    fleet_verb("status", checkpoint_id=False)
    fleet_verb("prepare")
    for name in ("commit", "checkpoint"):
        sub = fleet_verb(name)
        if name == "commit":
            sub.add_argument("--dir", required=True, help="absolute checkpoint directory")
        else:
            sub.add_argument(
                "--root", help="checkpoint root (default: the fleet file's checkpoint_root)"
            )
            sub.add_argument(
                "--keep-closed", action="store_true", help="leave the fleet closed afterwards"
            )
            sub.add_argument(
                "--keep",
                type=int,
                default=None,
                help="published checkpoints kept (default: the fleet file's keep, else 2)",
            )
        scope = sub.add_mutually_exclusive_group()
        scope.add_argument(
            "--episode",
            action="append",
            type=_episode,
            help="an episode in scope (repeat; default: every member's live episodes)",
        )
        scope.add_argument(
            "--unscoped", action="store_true", help="every member commits all its live episodes"
        )
    sub = fleet_verb("restore")
    sub.add_argument("--root", help="checkpoint root (default: the fleet file's checkpoint_root)")
    sub.add_argument("--source", default="LATEST", help="the published checkpoint's id")
    sub.add_argument(
        "--episode",
        action="append",
        type=_episode,
        help="continue only these (repeat; default: every episode the checkpoint continues)",
    )
    fleet_verb("resume")
    sub = fleet_verb("retire")
    sub.add_argument("episodes", nargs="+", type=_episode, help="rollout ids or capture keys")
    sub = fleet_verb("forget")
    sub.add_argument("rollout_ids", nargs="+", help="rollout ids")
    fleet_verb("renew")
    _add_health_verb(verbs)
    sub = verbs.add_parser(
        "inspect",
        help="verify every manifest and digest of a checkpoint directory",
        description="Verify a published checkpoint completely (fleet manifest, every part's "
        "manifest, digest, record count and size). Given a checkpoint root (or a collect "
        "--checkpoint-dir), inspects the checkpoint its LATEST names.",
        epilog=epilog("rollout-checkpoint inspect /checkpoints/run-7"),
        formatter_class=HelpFormatter,
    )
    sub.add_argument("directory", type=Path, help="a checkpoint directory or a checkpoint root")
    sub.add_argument("--json", action="store_true", help="machine-readable output, one JSON object")
    sub = verbs.add_parser(
        "coordinator",
        help="serve CoordinatorService for a fleet",
        description="Serve rollout_checkpoint.v1.CoordinatorService for one fleet: the fleet "
        "verbs as typed RPCs for controllers in any language. Prints one JSON line "
        "(`grpc`, `pid`, `members`) once it listens; SIGTERM stops it.",
        epilog=epilog(
            "rollout-checkpoint coordinator --fleet fleet.toml --grpc-address 0.0.0.0:9100"
        ),
        formatter_class=HelpFormatter,
    )
    sub.add_argument("--fleet", type=Path, required=True, help="fleet file (TOML or YAML)")
    sub.add_argument(
        "--grpc-address",
        default="127.0.0.1:0",
        help="HOST:PORT to serve on (port 0 picks a free one)",
    )
    sub.add_argument(
        "--reflection", action="store_true", help="serve gRPC server reflection (for grpcurl)"
    )


def _add_health_verb(verbs: Any) -> None:
    sub = verbs.add_parser(
        "health",
        help="gRPC health Check of a participant (no token needed)",
        description="Ask a sidecar's grpc.health.v1.Health for each of its names: "
        f"`{READINESS_HEALTH}` (may new traffic come here?), `{LIVENESS_HEALTH}` (restart "
        'me?) and the whole server (`""`). Exit 0 when every asked name is SERVING, 4 when '
        "one is not, 5 when the sidecar cannot be reached.",
        epilog=epilog(
            f"rollout-checkpoint health --address 127.0.0.1:9001 --service {READINESS_HEALTH}"
        ),
        formatter_class=HelpFormatter,
    )
    sub.add_argument("--address", required=True, help="the participant's sidecar HOST:PORT")
    sub.add_argument(
        "--service",
        action="append",
        default=None,
        help=f"a health name (repeat; default: {READINESS_HEALTH}, {LIVENESS_HEALTH} and the server)",
    )
    sub.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for the sidecar to answer (a server still starting)",
    )
    sub.add_argument("--tls-ca-file", type=Path, default=None, help="CA for a TLS sidecar")
    sub.add_argument("--json", action="store_true", help="machine-readable output, one JSON object")


def _episode(text: str) -> EpisodeId:
    """`rollout_id` or a capture key such as `r-a2`; argparse turns the error into usage."""
    try:
        return EpisodeId.from_capture_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def is_fleet_command(name: str) -> bool:
    return name in FLEET_VERBS or name in ("inspect", "coordinator", "health")


def run(args: argparse.Namespace) -> int:
    """Run one fleet verb (or `health`, `inspect`, `coordinator`); returns the exit code."""
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "coordinator":
        return run_async(lambda signals: _coordinator(args))
    if args.command == "health":
        return run_async(lambda signals: _health(args))
    return run_async(lambda signals: _fleet_command(args, signals))


def classify(error: BaseException) -> CliError | None:
    """The exit code and one line for an exception of the client library (None: a bug)."""
    if isinstance(error, FleetConfigError):
        return CliError(ExitCode.USAGE, str(error))
    if isinstance(error, DiscoveryError):
        refused = error.refused  # e.g. a wrong token: waiting will not help
        return CliError(
            ExitCode.REFUSED if refused else ExitCode.UNREACHABLE,
            str(error),
            Reason.PARTICIPANT_FAILED if refused else Reason.PARTICIPANT_UNREACHABLE,
            {"failures": error.failures},
        )
    if isinstance(error, FleetError):
        return CliError(
            ExitCode.UNREACHABLE
            if error.reason == Reason.PARTICIPANT_UNREACHABLE
            else ExitCode.REFUSED,
            _fleet_error_line(error),
            error.reason,
            {"failures": coordination.describe_failures(error)},
        )
    if isinstance(error, ControlError):
        return control_error(error)
    if isinstance(error, CheckpointCorrupt):
        return CliError(ExitCode.CORRUPT, str(error), Reason.INVALID_CHECKPOINT_STATE)
    if isinstance(error, PublicationError):
        return CliError(ExitCode.REFUSED, str(error), Reason.INVALID_CHECKPOINT_STATE)
    if isinstance(error, OSError) and error.filename is not None:
        # A fleet file, a token file or a checkpoint root that cannot be read or made.
        return CliError(ExitCode.USAGE, f"{error.filename}: {error.strerror or error}")
    if isinstance(error, ValueError):
        return CliError(ExitCode.USAGE, str(error))
    return None


CONFLICT_METADATA = "activeCheckpointId"


def control_error(error: ControlError) -> CliError:
    """One participant's refusal (exit 4, or 6 for a checkpoint that does not verify) or a
    transport failure (exit 5), naming the active checkpoint of a conflict."""
    if not error.decided_by_server:
        return CliError(
            ExitCode.UNREACHABLE,
            f"{error.code.name}: {error.message}",
            Reason.PARTICIPANT_UNREACHABLE,
        )
    code = ExitCode.CORRUPT if error.reason == Reason.INVALID_CHECKPOINT_STATE else ExitCode.REFUSED
    return CliError(
        code,
        error.message + _active_suffix(error),
        error.reason,
        {"code": error.code.name, "metadata": error.metadata},
    )


def _active_suffix(error: ControlError) -> str:
    active = error.metadata.get(CONFLICT_METADATA)
    if active and active not in error.message:
        return f" (active checkpoint: {active})"
    return ""


def _fleet_error_line(error: FleetError) -> str:
    details = "; ".join(
        f"{name}: {failure.reason or failure.code.name}: {failure.message}{_active_suffix(failure)}"
        for name, failure in error.failures.items()
    )
    return f"{error.operation} failed on {len(error.failures)} member(s): {details}"


def _token(args: argparse.Namespace) -> str:
    token: str
    if args.token_file is not None:
        token = args.token_file.read_text().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise FleetConfigError(f"no token: pass --token-file or set ${TOKEN_ENV}")
    return token


def _spec(args: argparse.Namespace) -> FleetSpec:
    if args.fleet is not None:
        if not args.fleet.is_file():
            raise FleetConfigError(f"{args.fleet}: no such fleet file")
        return load_fleet_file(args.fleet)
    return FleetSpec.from_addresses(args.address, _token(args), allow_agents_without_model=True)


def _root(args: argparse.Namespace, spec: FleetSpec) -> CheckpointRoot:
    root = getattr(args, "root", None) or spec.checkpoint_root
    if root is None:
        raise FleetConfigError(
            "no checkpoint root: pass --root or set checkpoint_root in the fleet file"
        )
    try:
        return CheckpointRoot(root)
    except OSError as error:
        raise FleetConfigError(
            f"checkpoint root {root}: {error.strerror or error} (it must be a directory "
            "this user can create and write)"
        ) from error


def resume_command(args: argparse.Namespace, checkpoint_id: str) -> str:
    """The exact command that reopens the fleet, for when an abort could not finish."""
    if args.fleet is not None:
        where = ["--fleet", str(args.fleet)]
    else:
        where = [part for address in args.address for part in ("--address", address)]
        if args.token_file is not None:
            where += ["--token-file", str(args.token_file)]
    return shlex.join([PROG, "resume", *where, checkpoint_id])


@dataclass
class OpenedCheckpoint:
    """The checkpoint a verb opened on the fleet (None until it did), for the abort."""

    checkpoint_id: str | None = None
    published: bool = False


async def _fleet_command(args: argparse.Namespace, signals: Signals) -> int:
    if args.command == "status":
        return await _status(args, _spec(args))
    spec = _spec(args)
    async with await Fleet.discover(spec) as fleet:
        opened = OpenedCheckpoint()
        try:
            return await _dispatch(args, fleet, spec, opened)
        except asyncio.CancelledError:
            if signals.received is None or opened.checkpoint_id is None:
                raise
            raise await _abort_after_signal(args, fleet, opened, signals.received) from None


async def _abort_after_signal(
    args: argparse.Namespace, fleet: Fleet, opened: OpenedCheckpoint, signum: int
) -> Interrupted:
    """Resume every member (reverse stage order) after a signal stopped a verb that opened a
    checkpoint; the `Interrupted` to end with says what happened and, if the abort could not
    finish, the exact command that does."""
    checkpoint_id = opened.checkpoint_id
    assert checkpoint_id is not None
    name = signal_name(signum)
    command = resume_command(args, checkpoint_id)
    try:
        await coordination.resume(fleet, checkpoint_id, time.time() + ABORT_SECONDS)
    except FleetError as error:
        return Interrupted(
            signum,
            f"interrupted by {name}; could not reopen {', '.join(error.failures)} "
            f"for {checkpoint_id}: {_fleet_error_line(error)}; run: {command}",
        )
    except asyncio.CancelledError:
        return Interrupted(
            signum, f"interrupted again while aborting {checkpoint_id}; run: {command}"
        )
    what = "published, then resumed" if opened.published else "aborted"
    return Interrupted(
        signum,
        f"interrupted by {name}: {what} {checkpoint_id}; all {len(fleet.members)} members "
        "resumed (admission open)",
    )


async def _dispatch(
    args: argparse.Namespace, fleet: Fleet, spec: FleetSpec, opened: OpenedCheckpoint
) -> int:
    output = Output.of(args)
    deadline = time.time() + getattr(args, "timeout", 0.0)
    command = args.command
    if command == "prepare":
        opened.checkpoint_id = args.checkpoint_id
        view = ProgressView(args.json)
        with view:
            last = await coordination.prepare_until_done(
                fleet, args.checkpoint_id, deadline, view.update
            )
        if not last.prepared:
            opened.checkpoint_id = None  # prepare's own answer: the members stay as they are
        view.final(last)
        output.result(
            f"prepare {args.checkpoint_id}: {last.outcome} in {last.elapsed:.2f} s, "
            f"{last.blocker_count()} blocker(s)",
            {"checkpoint_id": args.checkpoint_id, **_progress_json(last)},
        )
        return ExitCode.OK if last.prepared else ExitCode.NOT_PREPARED
    if command == "commit":
        result = await coordination.commit(
            fleet, args.checkpoint_id, deadline, args.dir, _scope(args)
        )
        output.result(
            f"committed {args.checkpoint_id} into {args.dir}: {len(result.members)} members, "
            f"{result.record_count()} records, {human_bytes(result.bytes())}",
            {n: _message_json(r) for n, r in result.members.items()},
        )
        return ExitCode.OK
    if command == "checkpoint":
        return await _checkpoint(args, output, fleet, spec, deadline, opened)
    if command == "restore":
        return await _restore(args, output, fleet, spec, deadline, opened)
    if command == "resume":
        return await _resume(args, output, fleet, deadline)
    if command == "retire":
        await coordination.retire(fleet, args.checkpoint_id, deadline, args.episodes)
        keys = [e.capture_key for e in args.episodes]
        output.result(
            f"retired {', '.join(keys)} on {len(fleet.members)} members", {"retired": keys}
        )
    elif command == "forget":
        await coordination.forget(fleet, args.checkpoint_id, deadline, args.rollout_ids)
        forgotten = sorted(set(args.rollout_ids))
        output.result(
            f"forgot {', '.join(forgotten)} on {len(fleet.members)} members",
            {"forgotten": forgotten},
        )
    elif command == "renew":
        earliest = rfc3339(await coordination.renew(fleet, args.checkpoint_id, deadline))
        output.result(
            f"renewed {args.checkpoint_id}: the earliest lease expires at {earliest}",
            {"lease_expires_at": earliest},
        )
    return ExitCode.OK


def _message_json(message: Message) -> dict[str, Any]:
    value: dict[str, Any] = MessageToDict(message, preserving_proto_field_name=True)
    return value


def _scope(args: argparse.Namespace) -> list[EpisodeId] | str | None:
    if args.unscoped:
        return None
    if args.episode:
        return list(args.episode)
    return DERIVE


async def _checkpoint(
    args: argparse.Namespace,
    output: Output,
    fleet: Fleet,
    spec: FleetSpec,
    deadline: float,
    opened: OpenedCheckpoint,
) -> int:
    root = _root(args, spec)
    checkpoint_id = args.checkpoint_id or root.new_checkpoint_id()
    opened.checkpoint_id = checkpoint_id
    view = ProgressView(args.json)
    started = time.monotonic()
    outcome: CheckpointOutcome | None = None
    with view:
        async for event in checkpoint(
            fleet,
            root,
            deadline,
            checkpoint_id=checkpoint_id,
            scope=_scope(args),
            keep=args.keep or spec.keep,
            keep_closed=args.keep_closed,
        ):
            view.event(event)
            outcome = event.outcome
            if event.phase == Phase.RESUME:
                opened.published = True
    assert outcome is not None
    opened.checkpoint_id = None  # the library resumed (or, with --keep-closed, was asked not to)
    total = time.monotonic() - started
    result: dict[str, Any] = {
        "checkpoint_id": outcome.checkpoint_id,
        "prepare_outcome": outcome.prepare_outcome,
        "published": outcome.published is not None,
        "directory": str(outcome.published.directory) if outcome.published else None,
        "members": len(fleet.members),
        "records": outcome.record_count,
        "bytes": outcome.bytes,
        "continued": [e.capture_key for e in outcome.continued],
        "seconds": {
            "prepare": outcome.prepare_seconds,
            "commit": outcome.commit_seconds,
            "publish": outcome.publish_seconds,
            "total": total,
        },
    }
    if outcome.published is None:
        blockers = (
            [
                {"member": m, "capture_key": b.capture_key, "detail": b.detail}
                for m, b in outcome.progress.blockers()
            ]
            if outcome.progress is not None
            else []
        )
        result["blockers"] = blockers
        summary = (
            f"not taken: {outcome.checkpoint_id} was {outcome.prepare_outcome} by the deadline "
            f"({len(blockers)} blocker(s){': ' if blockers else ''}"
            + ", ".join(f"{b['member']}:{b['capture_key'] or '-'}" for b in blockers[:5])
            + "); the fleet was resumed"
        )
    else:
        state = "left closed (--keep-closed)" if args.keep_closed else "resumed"
        summary = (
            f"published {outcome.checkpoint_id} at {outcome.published.directory}: "
            f"{len(fleet.members)} members, {len(outcome.continued)} episodes, "
            f"{outcome.record_count} records, {human_bytes(outcome.bytes)}, "
            f"prepare {outcome.prepare_seconds:.2f} s, total {total:.1f} s; fleet {state}"
        )
    if output.as_json:
        output.json_line({"result": result})
    else:
        output.result(summary, result)
    return ExitCode.OK if outcome.published is not None else ExitCode.NOT_PREPARED


async def _restore(
    args: argparse.Namespace,
    output: Output,
    fleet: Fleet,
    spec: FleetSpec,
    deadline: float,
    opened: OpenedCheckpoint,
) -> int:
    root = _root(args, spec)
    started = time.monotonic()
    opened.checkpoint_id = args.checkpoint_id
    restored = await restore_published(
        fleet, root, args.checkpoint_id, deadline, source=args.source, scope=args.episode
    )
    opened.checkpoint_id = None  # restored: the fleet stays closed until the operator resumes
    replies = {n: list(r.restored) for n, r in restored.replies.items()}  # type: ignore[attr-defined]
    details = {
        "checkpoint_id": args.checkpoint_id,
        "source_checkpoint_id": restored.source_checkpoint_id,
        "continued": len(restored.continued),
        "restored": replies,
        "next": f"{PROG} resume ... {args.checkpoint_id}",
    }
    installed = sum(len(keys) for keys in replies.values())
    output.result(
        f"restored {restored.source_checkpoint_id} as {args.checkpoint_id}: "
        f"{len(fleet.members)} members, {len(restored.continued)} episodes "
        f"({installed} installs), {time.monotonic() - started:.1f} s; the fleet stays closed "
        f"until: {resume_command(args, args.checkpoint_id)}",
        details,
    )
    return ExitCode.OK


async def _resume(args: argparse.Namespace, output: Output, fleet: Fleet, deadline: float) -> int:
    replies = await coordination.resume(fleet, args.checkpoint_id, deadline)
    statuses = await asyncio.gather(
        *(m.client.get_status() for m in fleet.members), return_exceptions=True
    )
    members: dict[str, dict[str, Any]] = {}
    for member, status in zip(fleet.members, statuses, strict=True):
        members[member.name] = {
            "idempotent": replies[member.name].idempotent,
            "admission_open": None if isinstance(status, BaseException) else status.admission_open,
        }
    open_count = sum(1 for m in members.values() if m["admission_open"])
    output.result(
        f"resumed {args.checkpoint_id}: {open_count} of {len(members)} members open",
        {"checkpoint_id": args.checkpoint_id, "members": members},
    )
    return ExitCode.OK


# -- status ---------------------------------------------------------------------------------


async def _health_status(
    address: str, service: str, credentials: grpc.ChannelCredentials | None
) -> str:
    """One grpc.health.v1 Check: `SERVING`, `NOT_SERVING`, `SERVICE_UNKNOWN`, or raises."""
    options = [("grpc.enable_retries", 0)]
    channel = (
        aio.insecure_channel(address, options=options)
        if credentials is None
        else aio.secure_channel(address, credentials, options=options)
    )
    async with channel:
        try:
            check = channel.unary_unary(
                HEALTH_CHECK_METHOD,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            reply: health_pb2.HealthCheckResponse = await check(
                health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_TIMEOUT_SECONDS
            )
        except aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise ControlError.from_rpc_error(error) from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def _member_row(spec: FleetSpec, member: MemberSpec) -> dict[str, Any]:
    """One member's status row; a member that cannot be asked is a row saying why."""
    row: dict[str, Any] = {"name": member.name, "address": member.address}
    credentials = spec.credentials()
    async with ParticipantClient(
        member.address, spec.token, credentials=credentials, timeout=HEALTH_TIMEOUT_SECONDS
    ) as client:
        try:
            described, status = await asyncio.gather(client.get_participant(), client.get_status())
            readiness = await _health_status(member.address, READINESS_HEALTH, credentials)
        except ControlError as error:
            row["error"] = control_error(error).message
            row["reachable"] = error.decided_by_server
            row["state"] = "refused" if error.decided_by_server else "unreachable"
            return row
    row.update(
        {
            "reachable": True,
            "kind": KIND_NAMES.get(described.kind, "?"),
            "instance": described.instance,
            "state": state_name(status.state, "?"),
            "checkpoint_id": status.checkpoint_id,
            "admission_open": status.admission_open,
            "ready": readiness == "SERVING",
            "readiness_health": readiness,
            "prepare_ready": status.readiness.ready,
            "blockers": status.readiness.blocker_count,
            "counts": dict(status.readiness.counts),
            "retired_rollouts": status.retired_rollouts,
            "restored_pending": status.restored_pending,
            "lease_expires_at": status.lease_expires_at.ToJsonString()
            if status.HasField("lease_expires_at")
            else None,
        }
    )
    return row


async def _status(args: argparse.Namespace, spec: FleetSpec) -> int:
    rows = await asyncio.gather(*(_member_row(spec, m) for m in spec.members))
    failed = [row for row in rows if "error" in row]
    code = ExitCode.OK
    if failed:
        code = (
            ExitCode.UNREACHABLE
            if any(not row["reachable"] for row in failed)
            else ExitCode.REFUSED
        )
    if args.json:
        payload: dict[str, Any] = {"members": rows}
        if failed:
            payload["error"] = {
                "reason": Reason.PARTICIPANT_UNREACHABLE
                if code == ExitCode.UNREACHABLE
                else Reason.PARTICIPANT_FAILED,
                "message": "; ".join(f"{row['name']}: {row['error']}" for row in failed),
                "exit_code": int(code),
            }
        print(json.dumps(payload, sort_keys=True), flush=True)
    else:
        _print_status_table(rows)
        for row in failed:
            print(f"{PROG}: {row['name']} ({row['address']}): {row['error']}", file=sys.stderr)
    return code


def _print_status_table(rows: Sequence[dict[str, Any]]) -> None:
    table = Table(title="fleet status")
    columns = ("name", "kind", "instance", "state", "checkpoint", "admission", "ready")
    for column in (*columns, "blockers", "lease expires", "counts"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        if "error" in row:
            table.add_row(
                row["name"], "-", "-", row["state"], "-", "-", "-", "-", "-", row["address"]
            )
            continue
        counts = " ".join(f"{k}={v}" for k, v in sorted(row["counts"].items()))
        table.add_row(
            row["name"],
            row["kind"],
            row["instance"],
            row["state"],
            row["checkpoint_id"] or "-",
            "open" if row["admission_open"] else "closed",
            "yes" if row["ready"] else "no",
            str(row["blockers"]),
            row["lease_expires_at"] or "-",
            counts,
        )
    make_console().print(table)


# -- health, inspect, coordinator ------------------------------------------------------------


async def _health(args: argparse.Namespace) -> int:
    services = args.service or [READINESS_HEALTH, LIVENESS_HEALTH, SERVER_HEALTH]
    credentials = (
        grpc.ssl_channel_credentials(args.tls_ca_file.read_bytes())
        if args.tls_ca_file is not None
        else None
    )
    give_up = time.monotonic() + args.wait
    while True:
        try:
            answers = {s: await _health_status(args.address, s, credentials) for s in services}
            break
        except ControlError as error:
            if error.decided_by_server or time.monotonic() >= give_up:
                raise
            await asyncio.sleep(0.1)
    if args.json:
        print(json.dumps({"address": args.address, "services": answers}, sort_keys=True))
    else:
        for service, answer in answers.items():
            print(f"{service or '(server)'}: {answer}")
    return ExitCode.OK if set(answers.values()) == {"SERVING"} else ExitCode.REFUSED


def _inspect(args: argparse.Namespace) -> int:
    directory: Path = args.directory
    if not directory.exists():
        raise CliError(ExitCode.USAGE, f"{directory}: no such directory")
    if not directory.is_dir():
        raise CliError(ExitCode.USAGE, f"{directory}: not a directory")
    note = None
    if not (directory / FLEET_MANIFEST_NAME).exists():
        directory, note = _what_directory_is(directory)
    summary = verify_checkpoint(directory)
    if args.json:
        print(json.dumps(summary.to_json(), sort_keys=True))
    else:
        if note:
            print(note)
        print(summary.format_text())
    return ExitCode.OK


def _what_directory_is(directory: Path) -> tuple[Path, str | None]:
    """Follow `LATEST` from a checkpoint root (or a collect --checkpoint-dir); refuse, saying
    what it is, a directory that holds no published checkpoint."""
    latest = directory / LATEST_NAME
    collect_dir = (directory / DISPATCH_LOG).exists()
    what = "a collect --checkpoint-dir" if collect_dir else "a checkpoint root"
    if latest.is_file():
        checkpoint_id = latest.read_text().strip()
        return directory / checkpoint_id, f"{directory} is {what}: LATEST names {checkpoint_id}"
    if collect_dir:
        raise CliError(
            ExitCode.USAGE,
            f"{directory} is a collect --checkpoint-dir with no published checkpoint yet (no "
            f"{LATEST_NAME})",
        )
    if (directory / PARTICIPANTS_DIR).is_dir():
        parts = sorted(
            f"{kind.name}/{instance.name}"
            for kind in (directory / PARTICIPANTS_DIR).iterdir()
            if kind.is_dir()
            for instance in kind.iterdir()
        )
        raise CliError(
            ExitCode.USAGE,
            f"{directory} holds committed parts ({', '.join(parts) or 'none'}) but no "
            f"{FLEET_MANIFEST_NAME}: a participant commit that was never published as a fleet "
            "checkpoint (`checkpoint` publishes; `commit` alone does not)",
        )
    return directory, None


async def _coordinator(args: argparse.Namespace) -> int:
    from rollout_checkpoint.client.coordinator.service import Coordinator

    if not args.fleet.is_file():
        raise FleetConfigError(f"{args.fleet}: no such fleet file")
    spec = load_fleet_file(args.fleet)
    coordinator = Coordinator(spec, args.grpc_address, reflection_enabled=args.reflection)

    def announce(server: Coordinator) -> None:
        host = args.grpc_address.rsplit(":", 1)[0]
        print(
            json.dumps(
                {"grpc": f"{host}:{server.port}", "pid": os.getpid(), "members": len(spec.members)}
            ),
            flush=True,
        )

    try:
        await coordinator.serve_forever(on_started=announce)
    except RuntimeError as error:
        if "bind" not in str(error).lower():
            raise
        raise CliError(
            ExitCode.ADDRESS_IN_USE, f"cannot listen on {args.grpc_address}: in use or invalid"
        ) from None
    return ExitCode.OK


# -- progress -------------------------------------------------------------------------------


class ProgressView:
    """Live progress on stderr: a rich table on a terminal, JSON lines (stdout) with --json,
    plain lines else."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.console = make_console(stderr=True)
        self.live: Live | None = None
        self.phase = Phase.PREPARE
        if not as_json and self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=10, transient=True)

    def __enter__(self) -> ProgressView:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def event(self, event: CheckpointEvent) -> None:
        self.phase = event.phase
        if event.progress is not None and event.phase == Phase.PREPARE:
            self.update(event.progress)
        elif self.as_json:
            print(
                json.dumps({"phase": event.phase, **{k: v for k, v in event.detail.items()}}),
                flush=True,
            )

    def update(self, progress: FleetProgress) -> None:
        if self.as_json:
            print(json.dumps(_progress_json(progress), sort_keys=True), flush=True)
        elif self.live is not None:
            self.live.update(_progress_table(progress, self.phase))

    def final(self, progress: FleetProgress) -> None:
        if not self.as_json:
            for member, blocker in progress.blockers():
                print(f"  {member}: {blocker.capture_key or '-'} {blocker.detail}", file=sys.stderr)


def _progress_json(progress: FleetProgress) -> dict[str, Any]:
    return {
        "phase": "PREPARE",
        "stage": KIND_NAMES.get(progress.stage, "?"),
        "sequence": progress.sequence,
        "elapsed": round(progress.elapsed, 6),
        "outcome": progress.outcome,
        "blocker_count": progress.blocker_count(),
        "members": [
            {
                "name": m.name,
                "reached": m.reached,
                "state": state_name(m.state, "-"),
                "blockers": m.readiness.blocker_count,
            }
            for m in progress.members
        ],
    }


def _progress_table(progress: FleetProgress, phase: str) -> Table:
    title = (
        f"{phase.lower()} — stage {KIND_NAMES.get(progress.stage, '?')} — {progress.elapsed:.2f}s"
    )
    if progress.outcome:
        title += f" — {progress.outcome}"
    table = Table(title=title)
    for column in ("member", "kind", "state", "blockers", "first blockers"):
        table.add_column(column)
    for member in progress.members:
        first = ", ".join(b.capture_key or "-" for b in list(member.readiness.blockers)[:3])
        state = state_name(member.state, "-") if member.reached else "not reached"
        table.add_row(
            member.name,
            KIND_NAMES.get(member.kind, "?"),
            state,
            str(member.readiness.blocker_count),
            first,
        )
    return table
