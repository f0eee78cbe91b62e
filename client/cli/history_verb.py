"""`history`: the checkpoint history of a root, read straight from the root (no coordinator).

What any coordinator, supervisor, `checkpoint` or `collect` of that root attempted, newest
first: a table, or one JSON object (`--json`) whose `entries` carry every field of
`publication.history.HistoryEntry`. `--id`: one attempt with its members (every field of
`MemberRecord`: what each member's commit, durable part or restore took, its blockers, its
part, its error), as a table or JSON. A corrupt history (JSON that does not decode or nests
too deep, a number outside its field's range, an index over 64 MiB), or with `--id` details
that are missing, not a file, too large or corrupt, is one line and exit 6; a root that is
not there, or an attempt that is not in it, is one line and exit 2."""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication import store_call_sync
from rollout_checkpoint.client.checkpointing.publication.history import (
    HistoryEntry,
    HistoryRead,
    MemberRecord,
    Status,
    open_history,
)
from rollout_checkpoint.client.cli.console import CliError, ExitCode, human_bytes
from rollout_checkpoint.server.core.object_store import is_object_url, parse_object_url

COLUMNS = ("STARTED", "ID", "OPERATION", "TRIGGER", "MODE", "STATUS", "DURATION", "BYTES")
MEMBER_COLUMNS = (
    "MEMBER",
    "KIND",
    "PREPARED",
    "BLOCKERS",
    "COMMIT",
    "DURABLE",
    "RESTORE",
    "RECORDS",
    "BYTES",
    "ERROR",
)


def history_verb(args: argparse.Namespace) -> int:
    """Print the history of `args.root`, newest first (`--failed`: only the attempts that did
    not complete; `--limit`: at most that many)."""
    deadline = time.time() + args.timeout
    read = store_call_sync(deadline, args.root, functools.partial(_read, args.root))
    if read.problem is not None:
        raise CliError(ExitCode.CORRUPT, read.problem)
    if args.id is not None:
        return _attempt_verb(args, attempt_of(read.entries, args.id), deadline)
    shown = selected(read.entries, failed=args.failed, limit=args.limit)
    if args.json:
        document = {
            "root": args.root,
            "total": len(read.entries),
            "entries": [e.to_json() for e in shown],
        }
        print(json.dumps(document, sort_keys=True))
    elif not read.entries:
        print(f"{args.root}: no checkpoint history yet")
    else:
        print(format_table(shown))
    return ExitCode.OK


def attempt_of(entries: Sequence[HistoryEntry], attempt_id: str) -> HistoryEntry:
    """The newest attempt named `attempt_id` (a retried id names several)."""
    for entry in reversed(entries):
        if entry.id == attempt_id:
            return entry
    raise CliError(ExitCode.USAGE, f"no attempt {attempt_id!r} in this root's history")


def _attempt_verb(args: argparse.Namespace, entry: HistoryEntry, deadline: float) -> int:
    """Print one attempt and its members (none when its details were dropped: only the newest
    attempts keep theirs)."""
    try:
        members = store_call_sync(
            deadline, args.root, functools.partial(open_history(args.root).members, entry)
        )
    except ValueError as exc:
        raise CliError(ExitCode.CORRUPT, f"{args.root}: {entry.details}: {exc}") from None
    if args.json:
        document = {
            "root": args.root,
            "entry": entry.to_json(),
            "members": [m.to_json() for m in members],
        }
        print(json.dumps(document, sort_keys=True))
        return ExitCode.OK
    print(format_table([entry]))
    if members:
        print()
        print(format_members(members))
    elif entry.members:
        print("\n(no per-member details: only the newest attempts keep theirs)")
    return ExitCode.OK


def format_members(members: Sequence[MemberRecord]) -> str:
    """One row per member: its prepare, commit, durable part or restore (seconds; "-" for
    what it did not do), its part's size and its error."""
    rows = [MEMBER_COLUMNS]
    for member in members:
        rows.append(
            (
                member.name,
                member.kind,
                _seconds(member.prepared_seconds),
                str(member.blockers_max),
                _seconds(member.commit_seconds),
                _seconds(member.durable_seconds),
                _seconds(member.restore_seconds),
                str(member.records),
                human_bytes(member.bytes),
                member.error or "-",
            )
        )
    return _aligned(rows)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def selected(
    entries: Sequence[HistoryEntry], *, failed: bool, limit: int | None
) -> list[HistoryEntry]:
    """Newest first; `failed`: only the attempts that did not complete."""
    newest_first = [e for e in reversed(entries) if not failed or e.status != Status.COMPLETED]
    return newest_first if limit is None else newest_first[:limit]


def format_table(entries: Sequence[HistoryEntry]) -> str:
    """One row per attempt, a reason (and the members that caused it) after a failure."""
    rows = [(*COLUMNS, "REASON")]
    for entry in entries:
        rows.append(
            (
                entry.started_at[:19].replace("T", " "),
                entry.id,
                entry.operation,
                entry.trigger,
                entry.mode,
                entry.status,
                f"{entry.duration_seconds:.2f}s",
                human_bytes(entry.bytes) if entry.operation == "checkpoint" else "-",
                _reason(entry),
            )
        )
    return _aligned(rows)


def _aligned(rows: Sequence[Sequence[str]]) -> str:
    """`rows` in columns two spaces apart, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _reason(entry: HistoryEntry) -> str:
    if not entry.reason:
        return ""
    members = f" ({', '.join(entry.failed_members)})" if entry.failed_members else ""
    return f"{entry.reason}{members}"


def _read(root: str) -> HistoryRead:
    """The root's history; a root that is not there is a usage error. Blocks on the store."""
    if is_object_url(root):
        try:
            parse_object_url(root)
        except ValueError as exc:
            raise CliError(ExitCode.USAGE, f"{root}: {exc}") from None
    elif not Path(root).is_dir():
        raise CliError(ExitCode.USAGE, f"{root}: no such checkpoint root (not a directory)")
    return open_history(root).read()
