"""The read side of a root's history (`history`), for an API that pages it many times a second.

A coordinator's history API (ListCheckpoints, `GET /checkpoints`, a dashboard polling it)
reads the same index over and over while it changes once per checkpoint. Parsing a
10,000-entry index takes a quarter of a second, so a `HistoryView` keeps the parsed index
(`HistorySnapshot`) and parses again only when the index changed, which it learns from what
changes with every write and costs no read of the bytes:

* locally, the index file's (mtime_ns, size, inode): every write replaces it by a rename
  (a new inode), so even two writes within the clock's resolution differ;
* on an object store, its ETag (one HEAD instead of a GET of megabytes).

When it did change, a checkpoint added one entry (and maybe dropped the oldest): every other
entry's line is the same bytes as before (`history.encode_index` writes one entry per line and
keeps the lines it does not change), so only new lines are decoded. A full parse holds the GIL
for most of a second at 10,000 entries, which would stall the coordinator's event loop (and
the checkpoints it is driving) once per checkpoint while a dashboard polls.

A corrupt index, or one of a newer format, is a snapshot with no entries and the problem
(as `History.read` reports it), never an exception: the API reports it and goes on serving.

Everything here blocks: run it through `store_call` from asyncio code.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from rollout_checkpoint.client.checkpointing.publication.history import (
    DETAILS_KEPT,
    INDEX_NAME,
    HistoryEntry,
    LocalHistory,
    MemberRecord,
    ObjectHistory,
    Status,
    decode_index,
    index_lines,
    open_history,
    parsed_json,
)

RESTORE = "restore"
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class HistoryCounts:
    """The whole history's attempts: checkpoints by how they ended, and restores."""

    completed: int = 0
    failed: int = 0
    aborted: int = 0
    restores: int = 0


class Anchor(NamedTuple):
    """Where a page ended: its last entry, by facts that do not change when older entries
    are dropped (a position would)."""

    id: str
    started_at: str
    ended_at: str

    @classmethod
    def of(cls, entry: HistoryEntry) -> Anchor:
        return cls(entry.id, entry.started_at, entry.ended_at)


@dataclass(frozen=True)
class HistoryPage:
    """One page of a snapshot, with what a list answers besides."""

    entries: list[HistoryEntry]
    following: Anchor | None
    """The anchor of the next page (None: this is the last)."""
    total: int
    """Entries matching the filters."""
    counts: HistoryCounts
    problem: str | None
    snapshot: HistorySnapshot


class HistorySnapshot:
    """One version of the index, parsed, newest first. What pages need beyond it (the
    counts, each entry's position by its anchor, each filter's positions) is computed on
    first use, once per version: a version that only ever answers first pages never builds
    the anchors, and a dashboard's repeated filter is filtered once."""

    def __init__(self, newest_first: tuple[HistoryEntry, ...], problem: str | None = None):
        self.newest_first = newest_first
        self.problem = problem
        self._lock = threading.Lock()
        self._counts: HistoryCounts | None = None
        self._positions: dict[Anchor, int] | None = None
        self._filtered: dict[tuple[str, str], Sequence[int]] = {}

    @property
    def counts(self) -> HistoryCounts:
        with self._lock:
            if self._counts is None:
                self._counts = _counts(self.newest_first)
            return self._counts

    def matching(self, status: str, operation: str) -> Sequence[int]:
        """The positions (ascending: newest first) of the entries with this `status` and
        `operation` ("" matches any)."""
        if not status and not operation:
            return range(len(self.newest_first))
        key = (status, operation)
        with self._lock:
            positions = self._filtered.get(key)
            if positions is None:
                positions = [
                    position
                    for position, entry in enumerate(self.newest_first)
                    if (not status or entry.status == status)
                    and (not operation or entry.operation == operation)
                ]
                self._filtered[key] = positions
            return positions

    def page(self, status: str, operation: str, size: int, after: Anchor | None) -> HistoryPage:
        """Up to `size` matching entries after `after` (None: from the newest). An anchor no
        longer in the index was dropped as one of the oldest, with everything older: the
        page is empty."""
        positions = self.matching(status, operation)
        start = 0
        if after is not None:
            anchored = self._position_of(after)
            start = len(positions) if anchored is None else bisect.bisect_right(positions, anchored)
        chosen = [self.newest_first[p] for p in positions[start : start + size]]
        more = start + size < len(positions)
        following = Anchor.of(chosen[-1]) if more and chosen else None
        return HistoryPage(chosen, following, len(positions), self.counts, self.problem, self)

    def newest(self, entry_id: str) -> tuple[HistoryEntry, bool] | None:
        """The newest attempt of `entry_id` (a retried id has several), and whether it is
        older than the `DETAILS_KEPT` newest attempts, whose details alone are kept (an
        entry without details is either that, or one that never had any)."""
        for position, entry in enumerate(self.newest_first):
            if entry.id == entry_id:
                return entry, position >= DETAILS_KEPT
        return None

    def _position_of(self, anchor: Anchor) -> int | None:
        with self._lock:
            if self._positions is None:
                # Oldest first, so of two equal anchors the newest position is the one kept.
                self._positions = {
                    Anchor.of(self.newest_first[p]): p
                    for p in range(len(self.newest_first) - 1, -1, -1)
                }
            return self._positions.get(anchor)


def _counts(entries: tuple[HistoryEntry, ...]) -> HistoryCounts:
    checkpoints = Counter(e.status for e in entries if e.operation != RESTORE)
    return HistoryCounts(
        completed=checkpoints[Status.COMPLETED],
        failed=checkpoints[Status.FAILED],
        aborted=checkpoints[Status.ABORTED],
        restores=sum(1 for e in entries if e.operation == RESTORE),
    )


class LineDecoder:
    """`decode_index`, reusing the entries of the lines it decoded from the previous index
    (an index in another layout is decoded whole). Not thread-safe: `HistoryView` calls it
    under its lock."""

    def __init__(self) -> None:
        self._entries: dict[bytes, HistoryEntry] = {}

    def __call__(self, raw: bytes) -> tuple[HistoryEntry, ...]:
        lines = index_lines(raw)
        if lines is None:
            self._entries = {}
            return decode_index(raw)
        previous = self._entries
        current: dict[bytes, HistoryEntry] = {}
        for line in lines:
            entry = previous.get(line) or current.get(line)
            current[line] = (
                entry if entry is not None else HistoryEntry.from_json(parsed_json(line))
            )
        self._entries = current  # only now: a line that fails leaves the previous ones
        return tuple(current[line] for line in lines)


class HistoryView:
    """A root's history, parsed once per version of its index (thread-safe: the reads run on
    `store_call`'s threads, one at a time, so two requests that both find the index changed
    decode it once)."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.history = open_history(location)
        self.location = self.history.location
        self._lock = threading.Lock()
        self._decode = LineDecoder()
        self._version: Hashable = None
        self._snapshot: HistorySnapshot | None = None

    def snapshot(self) -> HistorySnapshot:
        """The index as it is now: the cached one while its version did not change. Raises
        `StorageFailed` (or OSError) when the store fails."""
        with self._lock:
            version = self._version_now()
            if self._snapshot is not None and version == self._version:
                return self._snapshot
            # Read after taking the version: a write in between is cached under the older
            # version, which the next call sees differ, and reads again (never the reverse).
            read = self.history.read(self._decode)
            self._version = version
            self._snapshot = HistorySnapshot(tuple(reversed(read.entries)), read.problem)
            return self._snapshot

    def page(self, status: str, operation: str, size: int, after: Anchor | None) -> HistoryPage:
        """`HistorySnapshot.page` of the index as it is now (the whole page is made here, on
        the caller's thread: at 10,000 entries a filter or the anchors are milliseconds of
        CPU that do not belong on an event loop)."""
        return self.snapshot().page(status, operation, size, after)

    def members(self, entry: HistoryEntry) -> tuple[MemberRecord, ...]:
        """`History.members`: never cached (a details object is read once per GetCheckpoint,
        and is never rewritten under its name)."""
        return self.history.members(entry)

    def details_version(self, entry: HistoryEntry) -> Hashable:
        """What changes when `entry`'s details object is written, replaced or removed (one
        stat or HEAD, never its bytes): what an answer built from it is cached under."""
        return self._version_of(entry.details)

    def _version_now(self) -> Hashable:
        """What changes with every write of the index (None: there is none)."""
        return self._version_of(INDEX_NAME)

    def _version_of(self, name: str) -> Hashable:
        history = self.history
        if isinstance(history, LocalHistory):
            try:
                stat = os.stat(history.root / name, follow_symlinks=False)
            except FileNotFoundError:
                return None
            return (stat.st_mtime_ns, stat.st_size, stat.st_ino, stat.st_mode)
        assert isinstance(history, ObjectHistory)
        return history.tag_of(name)
