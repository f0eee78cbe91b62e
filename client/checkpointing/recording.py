"""Recording every checkpoint and restore attempt into its root's history
(`publication.history`), from what the attempt already knows: no call to any member.

Two rules keep the history from ever costing a checkpoint:

* **Written after the fleet runs again**: a checkpoint's record is written once it resumed
  (or aborted, which resumes too), so the fleet's pause never includes it.
* **Never a failure or a delay of its own**: a history that cannot be written (a read-only
  root, a store down) is logged and counted in `WRITES`, and the attempt's own result is what
  its caller gets; its caller waits for the write at most `HISTORY_SECONDS` and never past the
  attempt's deadline (a hung store: the write goes on in the background).
* **A process that ends waits for its records a little** (`finish_records`): the write that
  goes on in the background runs on a daemon thread, which dies with a short-lived process
  (the CLI), so an attempt that failed at its deadline (the very one an operator looks for)
  would leave no record at all. Its exit waits at most `HISTORY_SECONDS` more for them.

What a checkpoint's record says of each member comes from the prepare's progress snapshots
(when it prepared, the most blockers it reported, how long it reported any), from its
commit reply (records, bytes, where its part is) and from when its commit was called and
answered, and its part found durable (`fanout.MemberTimes`, taken where the fan-out already
is); a restore's, from when each Restore was called and answered. Snapshots share the
entries of members that did not change, so watching them costs one identity check per member
and snapshot; that pass waits until the record is built, after the resume (`WATCH_BATCH`):
during the prepare it was CPU of the fleet's pause (a 1,000-member prepare yields a hundred
snapshots or so: 100,000 checks).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from rollout_checkpoint.client.checkpointing.fanout import (
    FleetCommit,
    FleetError,
    FleetProgress,
    MemberProgress,
    MemberTimes,
    Outcome,
)
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    PublicationRoot,
    format_time,
    reason_of,
)
from rollout_checkpoint.client.checkpointing.publication.history import (
    DEFAULT_HISTORY_BYTES,
    MESSAGE_LIMIT,
    HistoryEntry,
    MemberRecord,
    StageTiming,
    Status,
    details_name,
    open_history,
)
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.server.core import daemon_threads, layout
from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

HISTORY_SECONDS = 5.0
"""The longest a history write may hold the caller of an attempt that already ended."""
_UNFINISHED: set[daemon_threads.StorageCall[None]] = set()
"""Records still being written on their daemon threads (`finish_records`)."""
INTERRUPTED = "INTERRUPTED"
"""The reason of an attempt stopped by its caller (a signal, a cancelled task)."""

_STAGES = {
    "PREPARE": "prepare",
    "SCOPE": "scope",
    "COMMIT": "commit",
    "PUBLISH": "publish",
    "RESUME": "resume",
    "AWAIT_PARTS": "durable",
}
"""The stage each `checkpoint.Phase` starts (an asynchronous commit is a `snapshot`)."""
_PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED
WATCH_BATCH = 256
"""The most prepare snapshots a recorder keeps unread: a longer prepare has them read as this
many accumulate (it waits on its members then, so the loop has the time), which bounds what
the recorder holds (at 1,000 members a snapshot is an 8 KB list)."""


@dataclass
class HistoryWrites:
    """How many history records this process wrote, and how many it could not."""

    written: int = 0
    failed: int = 0


WRITES = HistoryWrites()


class Finished(Protocol):
    """What a checkpoint's record reads of its outcome (`checkpoint.CheckpointOutcome`)."""

    @property
    def prepare_outcome(self) -> str: ...
    @property
    def published(self) -> object | None: ...
    @property
    def commit(self) -> FleetCommit | None: ...
    @property
    def continued(self) -> Sequence[object]: ...
    @property
    def retention_seconds(self) -> float: ...


@dataclass
class _MemberWatch:
    prepared_at: float | None = None
    blockers_max: int = 0
    blocked_since: float | None = None
    last_elapsed: float = 0.0


@dataclass
class CheckpointRecorder:
    """Watches one checkpoint's events and writes its record when it ends."""

    fleet: Fleet
    root: PublicationRoot
    checkpoint_id: str
    deadline: float
    trigger: str
    asynchronous: bool
    max_bytes: int = DEFAULT_HISTORY_BYTES
    started: float = field(default_factory=time.time)
    times: MemberTimes = field(default_factory=MemberTimes)
    """Each member's commit (pass it to `fanout.commit` and `fanout.await_parts`)."""
    _stages: list[tuple[str, float]] = field(default_factory=list)
    _watch: dict[str, _MemberWatch] = field(default_factory=dict)
    _seen: Sequence[MemberProgress | None] = ()
    _unread: list[FleetProgress] = field(default_factory=list)
    _progress: FleetProgress | None = None
    _recorded: bool = False

    def __post_init__(self) -> None:
        self._stages.append(("prepare", self.started))
        # An id that is no checkpoint id is refused before anything is attempted: nothing
        # to record (and it must never become a file name in the root).
        self._recorded = not is_valid_id(self.checkpoint_id)

    def observe(self, phase: str, progress: FleetProgress | None) -> None:
        """Note a phase's start and what the prepare's snapshot says of each member."""
        stage = _STAGES.get(phase)
        if stage == "commit" and self.asynchronous:
            stage = "snapshot"
        if stage is not None and (not self._stages or self._stages[-1][0] != stage):
            self._stages.append((stage, time.time()))
        if progress is not None and progress is not self._progress:
            self._progress = progress
            self._unread.append(progress)
            if len(self._unread) >= WATCH_BATCH:
                self._read_snapshots()

    def _read_snapshots(self) -> None:
        """Watch every member through the snapshots not read yet, in their order."""
        for progress in self._unread:
            self._watch_members(progress)
        self._unread.clear()

    def _watch_members(self, progress: FleetProgress) -> None:
        # A snapshot's list is never changed once yielded: the last one is what was seen.
        previous = self._seen
        self._seen = progress.members
        if len(previous) != len(progress.members):
            previous = [None] * len(progress.members)
        changed = [m for m, seen in zip(progress.members, previous, strict=True) if m is not seen]
        for member in changed:
            watch = self._watch.setdefault(member.name, _MemberWatch())
            watch.last_elapsed = progress.elapsed
            if member.state == _PREPARED:
                if watch.prepared_at is None:
                    watch.prepared_at = progress.elapsed
                continue
            count = member.readiness.blocker_count
            watch.blockers_max = max(watch.blockers_max, count)
            if count and watch.blocked_since is None:
                watch.blocked_since = progress.elapsed

    async def finished(self, outcome: Finished) -> None:
        """Record a checkpoint that ended with an outcome: published, or not prepared."""
        if outcome.prepare_outcome != Outcome.PREPARED:
            status, reason = Status.ABORTED, outcome.prepare_outcome
            culprits = {name: reason for name in self._unprepared()}
            message = f"the fleet was not prepared ({reason}); it was resumed"
        else:  # the last event after a prepare is the published checkpoint's
            status, reason, culprits, message = Status.COMPLETED, "", {}, ""
        ended = time.time()
        retention_started = ended - outcome.retention_seconds
        if outcome.published is not None:
            self._stages.append(("retention", retention_started))
        await self._write(
            status,
            ended,
            reason=reason,
            message=message,
            culprits=culprits,
            commit=outcome.commit,
            continued=len(outcome.continued),
        )

    async def failed(self, error: Exception) -> None:
        """Record a checkpoint that raised (after it aborted: the fleet runs again)."""
        reason, culprits = failure_of(error)
        await self._write(
            Status.FAILED, time.time(), reason=reason, message=str(error), culprits=culprits
        )

    def interrupted(self) -> None:
        """Record a checkpoint its caller stopped (cancelled, closed): written on a daemon
        thread, never awaited, since a cancelled task must not wait on a store."""
        if self._recorded:
            return
        self._recorded = True
        entry, members = self._entry(Status.ABORTED, time.time(), INTERRUPTED, "interrupted")
        start_write(self.root, entry, members, self.max_bytes)

    def _unprepared(self) -> tuple[str, ...]:
        progress = self._progress
        if progress is None:
            return ()
        return tuple(m.name for m in progress.members if m.reached and m.state != _PREPARED)

    async def _write(
        self,
        status: Status,
        ended: float,
        *,
        reason: str,
        message: str,
        culprits: Mapping[str, str],
        commit: FleetCommit | None = None,
        continued: int = 0,
    ) -> None:
        if self._recorded:
            return
        self._recorded = True
        entry, members = self._entry(status, ended, reason, message, culprits, commit, continued)
        await write_record(self.root, entry, members, self.deadline, self.max_bytes)

    def _entry(
        self,
        status: Status,
        ended: float,
        reason: str,
        message: str,
        culprits: Mapping[str, str] | None = None,
        commit: FleetCommit | None = None,
        continued: int = 0,
    ) -> tuple[HistoryEntry, list[MemberRecord]]:
        culprits = culprits or {}
        self._read_snapshots()
        members = self._member_records(commit, culprits)
        entry = _attempt(
            "checkpoint",
            self.checkpoint_id,
            self.trigger,
            "async" if self.asynchronous else "sync",
            status,
            (self.started, ended),
            (reason, message, culprits),
            stages=_timings(self._stages, ended),
            members=len(self.fleet.members),
            records=commit.record_count() if commit is not None else 0,
            bytes=commit.bytes() if commit is not None else 0,
            continued=continued,
            details=details_name(self.checkpoint_id),
        )
        return entry, members

    def _member_records(
        self, commit: FleetCommit | None, culprits: Mapping[str, str]
    ) -> list[MemberRecord]:
        directory = str(self.root.directory(self.checkpoint_id))
        records = []
        for member in self.fleet.members:
            watch = self._watch.get(member.name, _MemberWatch())
            reply = commit.members.get(member.name) if commit is not None else None
            blocked_until = watch.prepared_at or watch.last_elapsed
            records.append(
                MemberRecord(
                    name=member.name,
                    kind=member.kind_name,
                    instance=member.instance,
                    part=layout.part_path(directory, member.kind_name, member.instance),
                    records=reply.manifest.record_count if reply is not None else 0,
                    bytes=reply.manifest.bytes if reply is not None else 0,
                    prepared_seconds=watch.prepared_at,
                    blockers_max=watch.blockers_max,
                    blocked_seconds=(
                        round(blocked_until - watch.blocked_since, 6)
                        if watch.blocked_since is not None
                        else 0.0
                    ),
                    error=culprits.get(member.name, ""),
                    commit_seconds=self.times.reply_seconds(member.name),
                    durable_seconds=(
                        self.times.durable_seconds(member.name) if self.asynchronous else None
                    ),
                )
            )
        return records


@dataclass
class RestoreRecorder:
    """Times one restore (or recovery) and writes its record when it ends."""

    fleet: Fleet
    root: PublicationRoot
    restore_id: str
    deadline: float
    trigger: str
    mode: str
    """`rejoin` (survivors take part) or `fresh` (processes started closed)."""
    started: float = field(default_factory=time.time)
    source: str = ""
    times: MemberTimes = field(default_factory=MemberTimes)
    """Each member's Restore (pass it to the fan-out of the Restore calls)."""

    async def completed(self, continued: int, restarted: int = 0) -> None:
        entry = self._entry(Status.COMPLETED, continued, restarted)
        await write_record(self.root, entry, self._member_records(entry), self.deadline)

    async def failed(self, error: Exception) -> None:
        reason, culprits = failure_of(error)
        entry = self._entry(Status.FAILED, 0, 0, reason, str(error), culprits)
        await write_record(self.root, entry, self._member_records(entry, culprits), self.deadline)

    def _member_records(
        self, entry: HistoryEntry, culprits: Mapping[str, str] | None = None
    ) -> list[MemberRecord]:
        """Each member's Restore, when the entry has a details object to hold them."""
        if not entry.details:
            return []
        culprits = culprits or {}
        return [
            MemberRecord(
                name=member.name,
                kind=member.kind_name,
                instance=member.instance,
                error=culprits.get(member.name, ""),
                restore_seconds=self.times.reply_seconds(member.name),
            )
            for member in self.fleet.members
        ]

    def _entry(
        self,
        status: Status,
        continued: int,
        restarted: int,
        reason: str = "",
        message: str = "",
        culprits: Mapping[str, str] | None = None,
    ) -> HistoryEntry:
        return _attempt(
            "restore",
            self.restore_id,
            self.trigger,
            self.mode,
            status,
            (self.started, time.time()),
            (reason, message, culprits or {}),
            members=len(self.fleet.members),
            source=self.source,
            continued=continued,
            restarted=restarted,
            # A control id that is no checkpoint id (the members refuse it) is recorded
            # without details: it must never become a file name in the root.
            details=details_name(self.restore_id) if is_valid_id(self.restore_id) else "",
        )


def _attempt(
    operation: str,
    attempt_id: str,
    trigger: str,
    mode: str,
    status: Status,
    times: tuple[float, float],
    failure: tuple[str, str, Mapping[str, str]],
    **counts: Any,
) -> HistoryEntry:
    """An entry: what both kinds of attempt say (times: started and ended, epoch seconds;
    failure: reason, message, culprits), and `counts`, what only one kind says."""
    started, ended = times
    reason, message, culprits = failure
    return HistoryEntry(
        id=attempt_id,
        operation=operation,
        trigger=trigger,
        mode=mode,
        status=status,
        started_at=_time(started),
        ended_at=_time(ended),
        duration_seconds=round(ended - started, 6),
        reason=reason,
        message=message[:MESSAGE_LIMIT],
        failed_members=tuple(sorted(culprits)),
        **counts,
    )


def failure_of(error: Exception) -> tuple[str, dict[str, str]]:
    """The typed reason of an attempt's failure, and the members that caused it with each
    one's own reason (`UNREACHABLE` for a member no call reached)."""
    if isinstance(error, FleetError):
        culprits = {n: e.reason or "UNREACHABLE" for n, e in error.failures.items()}
        return str(error.reason), culprits
    if isinstance(error, CheckpointError):
        named = error.metadata.get("awaitingRestore", "")
        return str(error.reason), {n: str(error.reason) for n in named.split(",") if n}
    if isinstance(error, PublicationError):
        return str(reason_of(error)), {}
    return type(error).__name__, {}


async def write_record(
    root: PublicationRoot,
    entry: HistoryEntry,
    members: Sequence[MemberRecord],
    deadline: float,
    max_bytes: int = DEFAULT_HISTORY_BYTES,
) -> None:
    """Append `entry` to `root`'s history, waiting at most `HISTORY_SECONDS` and never past
    the attempt's `deadline`: an attempt that failed at its deadline (a store that hangs)
    must end then, not a history write later. A write still running then finishes in the
    background (while the process lives); a failure is logged and counted, never raised."""
    call = start_write(root, entry, members, max_bytes)
    if call is None:
        return
    try:
        async with asyncio.timeout(max(0.0, min(HISTORY_SECONDS, deadline - time.time()))):
            await asyncio.shield(asyncio.wrap_future(call.future))
    except TimeoutError:
        log.info("%s %s: its history record is still being written", entry.operation, entry.id)
        _UNFINISHED.add(call)
        call.future.add_done_callback(lambda _: _UNFINISHED.discard(call))


async def finish_records(seconds: float = HISTORY_SECONDS) -> None:
    """Wait at most `seconds` for the records still being written: a process about to end
    calls it, since its daemon threads end with it (the module docstring's last rule)."""
    unfinished = [asyncio.wrap_future(call.future) for call in list(_UNFINISHED)]
    if not unfinished:
        return
    _, pending = await asyncio.wait(unfinished, timeout=seconds)
    if pending:
        log.warning("%d history record(s) not written before the process ended", len(pending))


def start_write(
    root: PublicationRoot,
    entry: HistoryEntry,
    members: Sequence[MemberRecord],
    max_bytes: int = DEFAULT_HISTORY_BYTES,
) -> daemon_threads.StorageCall[None] | None:
    """Start appending `entry` on a daemon thread, which counts (`WRITES`) and logs how it
    ended; None when the root's history cannot even be opened (counted, logged)."""
    try:
        history = open_history(root.location)
    except Exception as error:
        _count_failure(entry, error)
        return None
    return daemon_threads.StorageCall(
        functools.partial(_append_logged, history.append, entry, members, max_bytes),
        f"history: record {entry.operation} {entry.id}",
    )


def _append_logged(
    append: _Append, entry: HistoryEntry, members: Sequence[MemberRecord], max_bytes: int
) -> None:
    try:
        append(entry, members, max_bytes=max_bytes)
    except Exception as error:
        _count_failure(entry, error)
    else:
        WRITES.written += 1


class _Append(Protocol):
    def __call__(
        self, entry: HistoryEntry, members: Sequence[MemberRecord], *, max_bytes: int
    ) -> None: ...


def _count_failure(entry: HistoryEntry, error: Exception) -> None:
    WRITES.failed += 1
    log.warning(
        "%s %s (%s): its history record was not written (%s); the %s itself is unaffected",
        entry.operation,
        entry.id,
        entry.status,
        error,
        entry.operation,
    )


def _time(epoch: float) -> str:
    return format_time(datetime.fromtimestamp(epoch, UTC))


def _timings(stages: Sequence[tuple[str, float]], ended: float) -> tuple[StageTiming, ...]:
    """Each stage from its start until the next one's (the last until `ended`): contiguous,
    so their sum is the attempt's duration."""
    marks = list(stages)
    ends = [at for _, at in marks[1:]] + [ended]
    return tuple(
        StageTiming(name, round(max(0.0, end - at), 6))
        for (name, at), end in zip(marks, ends, strict=True)
    )
