"""The read side of a root's history (`history`), for an API that pages it many times a second.

A coordinator's history API (ListCheckpoints, `GET /checkpoints`, a dashboard polling it)
reads the same index over and over while it changes once per checkpoint. Parsing a
10,000-entry index takes a quarter of a second, so a `HistoryView` keeps the parsed index
(`HistorySnapshot`) and parses again only when the index changed, which it learns from what
changes with every write and costs no read of the bytes:

* locally, the index file's (mtime_ns, size, inode): every write replaces it by a rename
  (a new inode), so even two writes within the clock's resolution differ;
* on an object store, its ETag (one HEAD instead of a GET of megabytes).

A corrupt index, or one of a newer format, is a snapshot with no entries and the problem
(as `History.read` reports it), never an exception: the API reports it and goes on serving.

Everything here blocks: run it through `store_call` from asyncio code.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

from rollout_checkpoint.client.checkpointing.publication.history import (
    DETAILS_KEPT,
    INDEX_NAME,
    HistoryEntry,
    LocalHistory,
    MemberRecord,
    ObjectHistory,
    Status,
    open_history,
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


@dataclass(frozen=True)
class Anchor:
    """Where a page ended: its last entry, by facts that do not change when older entries
    are dropped (a position would)."""

    id: str
    started_at: str
    ended_at: str

    @classmethod
    def of(cls, entry: HistoryEntry) -> Anchor:
        return cls(entry.id, entry.started_at, entry.ended_at)


@dataclass
class HistorySnapshot:
    """One version of the index, parsed, newest first, with what every page needs computed
    once: the counts, each entry's position by its anchor, and (on first use) each filter's
    positions."""

    newest_first: tuple[HistoryEntry, ...]
    problem: str | None = None
    counts: HistoryCounts = field(init=False)
    _positions: dict[Anchor, int] = field(init=False, repr=False)
    _filtered: dict[tuple[str, str], list[int]] = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.counts = _counts(self.newest_first)
        # Newest first: the first position of an anchor (or id) is its newest attempt.
        self._positions = {}
        for position, entry in enumerate(self.newest_first):
            self._positions.setdefault(Anchor.of(entry), position)
        self._filtered = {}

    def matching(self, status: str, operation: str) -> list[int]:
        """The positions (ascending: newest first) of the entries with this `status` and
        `operation` ("" matches any)."""
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

    def page(
        self, status: str, operation: str, size: int, after: Anchor | None
    ) -> tuple[list[HistoryEntry], Anchor | None]:
        """Up to `size` matching entries after `after` (None: from the newest), and the anchor
        of the next page (None: this is the last). An anchor no longer in the index was
        dropped as one of the oldest, with everything older: the page is empty."""
        positions = self.matching(status, operation)
        start = 0
        if after is not None:
            anchored = self._positions.get(after)
            if anchored is None:
                return [], None
            start = bisect.bisect_right(positions, anchored)
        chosen = [self.newest_first[p] for p in positions[start : start + size]]
        more = start + size < len(positions)
        return chosen, Anchor.of(chosen[-1]) if more and chosen else None

    def newest(self, entry_id: str) -> tuple[HistoryEntry, bool] | None:
        """The newest attempt of `entry_id` (a retried id has several), and whether it is
        older than the `DETAILS_KEPT` newest attempts, whose details alone are kept (an
        entry without details is either that, or one that never had any)."""
        for position, entry in enumerate(self.newest_first):
            if entry.id == entry_id:
                return entry, position >= DETAILS_KEPT
        return None


def _counts(entries: tuple[HistoryEntry, ...]) -> HistoryCounts:
    by_status = {Status.COMPLETED: 0, Status.FAILED: 0, Status.ABORTED: 0}
    restores = 0
    for entry in entries:
        if entry.operation == RESTORE:
            restores += 1
        elif entry.status in by_status:
            by_status[Status(entry.status)] += 1
    return HistoryCounts(
        completed=by_status[Status.COMPLETED],
        failed=by_status[Status.FAILED],
        aborted=by_status[Status.ABORTED],
        restores=restores,
    )


class HistoryView:
    """A root's history, parsed once per version of its index (thread-safe: the reads run on
    `store_call`'s threads)."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.history = open_history(location)
        self.location = self.history.location
        self._lock = threading.Lock()
        self._version: Hashable = None
        self._snapshot: HistorySnapshot | None = None

    def snapshot(self) -> HistorySnapshot:
        """The index as it is now: the cached one while its version did not change. Raises
        `StorageFailed` (or OSError) when the store fails."""
        version = self._version_now()
        with self._lock:
            if self._snapshot is not None and version == self._version:
                return self._snapshot
        # Read after taking the version: a write in between is cached under the older
        # version, which the next call sees differ, and reads again (never the reverse).
        read = self.history.read()
        snapshot = HistorySnapshot(tuple(reversed(read.entries)), read.problem)
        with self._lock:
            self._version, self._snapshot = version, snapshot
        return snapshot

    def members(self, entry: HistoryEntry) -> tuple[MemberRecord, ...]:
        """`History.members`: never cached (a details object is read once per GetCheckpoint,
        and is never rewritten under its name)."""
        return self.history.members(entry)

    def _version_now(self) -> Hashable:
        """What changes with every write of the index (None: there is none)."""
        history = self.history
        if isinstance(history, LocalHistory):
            try:
                stat = os.stat(history.root / INDEX_NAME, follow_symlinks=False)
            except FileNotFoundError:
                return None
            return (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        assert isinstance(history, ObjectHistory)
        return history.index_tag()
