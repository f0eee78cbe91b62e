"""The fleet verbs that act on every member: prepare, commit, checkpoint, restore, resume,
retire, forget, renew (and `status`, dispatched to `status`).

A verb that opens a checkpoint on the fleet (`prepare`, `checkpoint`, `restore`) records it in
`OpenedCheckpoint` and aborts it when SIGINT or SIGTERM stops it — Resume on every member in
reverse stage order — because a fleet left closed takes no traffic until its lease expires."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import (
    ABORT_SECONDS,
    CheckpointOutcome,
    Phase,
    checkpoint,
    restore_published,
)
from rollout_checkpoint.client.checkpointing.fanout import DERIVE, FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationRoot,
    open_checkpoint_root,
    store_call,
)
from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.cli.console import (
    PROG,
    ExitCode,
    Interrupted,
    Output,
    Signals,
    human_bytes,
    signal_name,
)
from rollout_checkpoint.client.cli.errors import fleet_error_line
from rollout_checkpoint.client.cli.names import TOKEN_ENV, rfc3339
from rollout_checkpoint.client.cli.progress import ProgressView, progress_json
from rollout_checkpoint.client.cli.status import status_verb
from rollout_checkpoint.client.fleet import Fleet, FleetConfigError, FleetSpec, load_fleet_file
from rollout_checkpoint.server.core.episodes import EpisodeId


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


async def _root(args: argparse.Namespace, spec: FleetSpec, deadline: float) -> PublicationRoot:
    """The verb's checkpoint root, opened by `deadline` (a local root is created, which
    blocks on a frozen filesystem: `StorageFailed` then)."""
    root = getattr(args, "root", None) or spec.checkpoint_root
    if root is None:
        raise FleetConfigError(
            "no checkpoint root: pass --root or set checkpoint_root in the fleet file"
        )
    try:
        return await store_call(deadline, str(root), open_checkpoint_root, root)
    except ValueError as error:  # an object-store URL that is no valid location
        raise FleetConfigError(f"checkpoint root {root}: {error}") from error
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


@dataclass
class VerbRun:
    """What a verb that opens a checkpoint works with: its arguments, where its result goes,
    the discovered fleet and its spec, the operation's deadline (epoch seconds), and the
    checkpoint it opened (for the abort after a signal)."""

    args: argparse.Namespace
    output: Output
    fleet: Fleet
    spec: FleetSpec
    deadline: float
    opened: OpenedCheckpoint

    def unpack(
        self,
    ) -> tuple[argparse.Namespace, Output, Fleet, FleetSpec, float, OpenedCheckpoint]:
        return self.args, self.output, self.fleet, self.spec, self.deadline, self.opened


async def fleet_command(args: argparse.Namespace, signals: Signals) -> int:
    """Run a fleet verb on the discovered fleet; the exit code.

    Raises the library's errors (for `errors.classify`); cancelled by a signal after it
    opened a checkpoint, it aborts the checkpoint and raises `Interrupted`."""
    if args.command == "status":
        return await status_verb(args, _spec(args))
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
        await fanout.resume(fleet, checkpoint_id, time.time() + ABORT_SECONDS)
    except FleetError as error:
        return Interrupted(
            signum,
            f"interrupted by {name}; could not reopen {', '.join(error.failures)} "
            f"for {checkpoint_id}: {fleet_error_line(error)}; run: {command}",
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
            last = await fanout.prepare_until_done(fleet, args.checkpoint_id, deadline, view.update)
        if not last.prepared:
            opened.checkpoint_id = None  # prepare's own answer: the members stay as they are
        view.final(last)
        output.result(
            f"prepare {args.checkpoint_id}: {last.outcome} in {last.elapsed:.2f} s, "
            f"{last.blocker_count()} blocker(s)",
            {"checkpoint_id": args.checkpoint_id, **progress_json(last)},
        )
        return ExitCode.OK if last.prepared else ExitCode.NOT_PREPARED
    if command == "commit":
        result = await fanout.commit(fleet, args.checkpoint_id, deadline, args.dir, _scope(args))
        output.result(
            f"committed {args.checkpoint_id} into {args.dir}: {len(result.members)} members, "
            f"{result.record_count()} records, {human_bytes(result.bytes())}",
            {n: _message_json(r) for n, r in result.members.items()},
        )
        return ExitCode.OK
    if command == "checkpoint":
        return await _checkpoint(VerbRun(args, output, fleet, spec, deadline, opened))
    if command == "restore":
        return await _restore(VerbRun(args, output, fleet, spec, deadline, opened))
    if command == "resume":
        return await _resume(args, output, fleet, deadline)
    if command == "retire":
        await fanout.retire(fleet, args.checkpoint_id, deadline, args.episodes)
        keys = [e.capture_key for e in args.episodes]
        output.result(
            f"retired {', '.join(keys)} on {len(fleet.members)} members", {"retired": keys}
        )
    elif command == "forget":
        await fanout.forget(fleet, args.checkpoint_id, deadline, args.rollout_ids)
        forgotten = sorted(set(args.rollout_ids))
        output.result(
            f"forgot {', '.join(forgotten)} on {len(fleet.members)} members",
            {"forgotten": forgotten},
        )
    elif command == "renew":
        earliest = rfc3339(await fanout.renew(fleet, args.checkpoint_id, deadline))
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


async def _checkpoint(run: VerbRun) -> int:
    args, output, fleet, spec, deadline, opened = run.unpack()
    root = await _root(args, spec, deadline)
    checkpoint_id = args.checkpoint_id or await store_call(
        deadline, root.location, root.new_checkpoint_id
    )
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
            asynchronous=spec.async_commit,
            trigger=Trigger.MANUAL,
        ):
            view.event(event)
            outcome = event.outcome
            if event.phase == Phase.RESUME and not event.detail.get("asynchronous"):
                # An asynchronous checkpoint resumes before it publishes: interrupted while
                # its parts are written, it was not published (resuming again is harmless).
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


async def _restore(run: VerbRun) -> int:
    args, output, fleet, spec, deadline, opened = run.unpack()
    root = await _root(args, spec, deadline)
    started = time.monotonic()
    opened.checkpoint_id = args.checkpoint_id
    restored = await restore_published(
        fleet,
        root,
        args.checkpoint_id,
        deadline,
        source=args.source,
        scope=args.episode,
        rejoin=args.rejoin,
        trigger=Trigger.MANUAL,
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
    replies = await fanout.resume(fleet, args.checkpoint_id, deadline)
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
