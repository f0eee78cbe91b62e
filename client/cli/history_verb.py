"""`history`: the checkpoint history of a root, read straight from the root (no coordinator).

What any coordinator, supervisor, `checkpoint` or `collect` of that root attempted, newest
first: a table, or one JSON object (`--json`) whose `entries` carry every field of
`publication.history.HistoryEntry`. A corrupt history is one line and exit 6; a root that is
not there is one line and exit 2."""

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
    Status,
    open_history,
)
from rollout_checkpoint.client.cli.console import CliError, ExitCode, human_bytes
from rollout_checkpoint.server.core.object_store import is_object_url, parse_object_url

COLUMNS = ("STARTED", "ID", "OPERATION", "TRIGGER", "MODE", "STATUS", "DURATION", "BYTES")


def history_verb(args: argparse.Namespace) -> int:
    """Print the history of `args.root`, newest first (`--failed`: only the attempts that did
    not complete; `--limit`: at most that many)."""
    deadline = time.time() + args.timeout
    read = store_call_sync(deadline, args.root, functools.partial(_read, args.root))
    if read.problem is not None:
        raise CliError(ExitCode.CORRUPT, read.problem)
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


def selected(
    entries: Sequence[HistoryEntry], *, failed: bool, limit: int | None
) -> list[HistoryEntry]:
    """Newest first; `failed`: only the attempts that did not complete."""
    newest_first = [e for e in reversed(entries) if not failed or e.status != Status.COMPLETED]
    return newest_first if limit is None else newest_first[:limit]


def format_table(entries: Sequence[HistoryEntry]) -> str:
    """One row per attempt, a reason (and the members that caused it) after a failure."""
    rows = [COLUMNS]
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
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for index, row in enumerate(rows):
        text = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        reason = _reason(entries[index - 1]) if index else "REASON"
        lines.append(f"{text}  {reason}".rstrip())
    return "\n".join(lines)


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
