"""Whole checkpoints of a fleet: prepare, commit, publish, resume — and restoring them.

The order is the crash-safety argument. Nothing is published until every member's part is
committed and verified, so a crash at any step leaves either the previous published
checkpoint or the new one, never a fleet manifest naming a part that does not exist. A
checkpoint that fails before publication is aborted (every member resumed), so the fleet never
stays closed for a checkpoint that will not exist. A restore verifies the whole published
checkpoint before any member installs anything, so a torn part is refused everywhere rather
than half installed.

An asynchronous checkpoint (`asynchronous=True`) moves the resume before the wait for
storage: prepare, snapshot on every member (Commit in its asynchronous mode), resume, wait
until every part is durable (AwaitPart), publish. The fleet pauses for the export, not for
the disk or the object store. The crash-safety argument is the same one: nothing is
published until every part is durable and its digest known, so a part that fails after the
resume (a full disk, a store down, a member killed mid-write) fails this checkpoint only:
the previous one stays `LATEST`, the fleet keeps running, and the next checkpoint goes ahead.

Retention (deleting the checkpoints `keep` no longer keeps) runs after the resume in both
orders: `LATEST` already names the new checkpoint, so no restore needs what it deletes, and
deleting a 1,000-member checkpoint was seconds of the fleet's pause when it ran inside the
publication.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import (
    DERIVE,
    FleetCommit,
    FleetError,
    FleetProgress,
    MemberTimes,
    Outcome,
    awaiting_restore,
)
from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointCorrupt,
    PublicationRoot,
    PublishedCheckpoint,
    PublishedParticipant,
    store_call,
)
from rollout_checkpoint.client.checkpointing.publication.history import (
    DEFAULT_HISTORY_BYTES,
    Trigger,
)
from rollout_checkpoint.client.checkpointing.recording import CheckpointRecorder, RestoreRecorder
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason

log = logging.getLogger(__name__)

ABORT_SECONDS = 30.0


class Phase:
    """The steps of a checkpoint, in order, as `CheckpointEvent.phase` names them."""

    PREPARE = "PREPARE"
    """Every stage is being prepared, in order; the event carries the progress."""
    SCOPE = "SCOPE"
    """The fleet is prepared; `fix_scope` is deciding the scope and the controller state."""
    COMMIT = "COMMIT"
    """Every member commits its part (asynchronous checkpoints: snapshots it)."""
    PUBLISH = "PUBLISH"
    """Every part is committed and durable; the fleet manifest is being published."""
    RESUME = "RESUME"
    """The fleet is being resumed (not with `keep_closed`)."""
    AWAIT_PARTS = "AWAIT_PARTS"
    """Asynchronous checkpoints: the fleet resumed; waiting until every part is durable."""
    DONE = "DONE"
    """The last event: it carries the `CheckpointOutcome`."""


@dataclass
class CheckpointOutcome:
    """What one checkpoint did: how its prepare ended, what was committed and published, and
    how long each step took (seconds). `published` is None when nothing was published."""

    checkpoint_id: str
    """The checkpoint's id (the control id of every call, and its directory's name)."""
    prepare_outcome: str
    """How the prepare ended (`Outcome`); nothing follows unless PREPARED."""
    published: PublishedCheckpoint | None = None
    """The publication (None when nothing was published: not prepared)."""
    commit: FleetCommit | None = None
    """Every member's commit reply and the scope (None when nothing was committed)."""
    continued: tuple[EpisodeId, ...] = ()
    """The episodes the published checkpoint continues, sorted."""
    prepare_seconds: float = 0.0
    """From the start until the prepare's outcome."""
    commit_seconds: float = 0.0
    """The commit (asynchronous checkpoints: until every member snapshotted)."""
    publish_seconds: float = 0.0
    """Verifying every part and publishing the fleet manifest."""
    progress: FleetProgress | None = None
    """The prepare's last snapshot."""
    asynchronous: bool = False
    """Whether the fleet resumed before its parts were durable."""
    durable_seconds: float = 0.0
    """Asynchronous checkpoints: from the resume until every part was durable."""
    resumed_seconds: float | None = None
    """From the start until every member answered its Resume: the fleet's pause as the
    controller saw it. None when the fleet was not resumed (`keep_closed`, not prepared)."""
    retention_seconds: float = 0.0
    """Deleting what retention no longer keeps, after the resume."""

    @property
    def record_count(self) -> int:
        """Records committed (0 when nothing was)."""
        return self.commit.record_count() if self.commit is not None else 0

    @property
    def bytes(self) -> int:
        """Bytes of records committed (0 when nothing was)."""
        return self.commit.bytes() if self.commit is not None else 0


ScopeFixer = Callable[[str], Awaitable[tuple[Iterable[EpisodeId], bytes]]]
"""Called with the checkpoint id once the fleet is prepared; returns (scope, controller state).

A controller that tracks its rollouts can only name the scope once nothing moves any more:
before prepare, a reply already on the wire could still finish a rollout it would name (and
restore a finished rollout as if it were running), or one it left out could park and be lost."""


@dataclass
class CheckpointEvent:
    """One step of a checkpoint: prepare progress, a phase change, or the final outcome."""

    phase: str
    """The step this event reports (`Phase`)."""
    progress: FleetProgress | None = None
    """The prepare's latest snapshot (None before the first)."""
    outcome: CheckpointOutcome | None = None
    """Set on the last event (`Phase.DONE`) only."""
    detail: dict[str, object] = field(default_factory=dict)
    """What the step adds: `records` and `bytes` at PUBLISH, `asynchronous` at COMMIT and RESUME,
    `resumed` at AWAIT_PARTS."""

    @property
    def final(self) -> bool:
        """Whether this is the last event (it carries the outcome)."""
        return self.phase == Phase.DONE


async def checkpoint(
    fleet: Fleet,
    root: PublicationRoot,
    deadline: float,
    *,
    checkpoint_id: str | None = None,
    scope: Iterable[EpisodeId] | str | None = DERIVE,
    controller_state: bytes = b"",
    keep: int = 2,
    keep_closed: bool = False,
    fix_scope: ScopeFixer | None = None,
    asynchronous: bool = False,
    trigger: str = Trigger.MANUAL,
    history_bytes: int = DEFAULT_HISTORY_BYTES,
) -> AsyncIterator[CheckpointEvent]:
    """Take and publish one checkpoint, yielding progress; the last event has the outcome.

    Every attempt leaves a record in the root's history (`recording`): `trigger` says what
    started it (`Trigger`), `history_bytes` caps the history. The record is written after
    the fleet runs again (after the resume, or the abort's), before the last event; a history
    that cannot be written never fails the checkpoint.

    With `fix_scope`, the scope and the controller state are decided after prepare succeeded
    (they replace `scope` and `controller_state`); a failure there aborts like any other.

    `asynchronous`: snapshot, resume, then wait for the parts and publish (see the module
    docstring). A part that fails after the resume raises `FleetError` ("await part") with
    nothing published; the fleet is already running.

    Both modes share every step up to the commit and after the publication; they differ in
    what the abort covers. Until every member answered its commit (synchronous: until the
    checkpoint is published) a failure aborts, resuming the fleet. After an asynchronous
    resume only the publication is at stake: a part that failed, a member that died or was
    replaced mid-write, or a write still running at `deadline` raises and publishes nothing,
    so `LATEST` keeps naming the previous complete checkpoint."""
    if checkpoint_id is None:
        checkpoint_id = await store_call(deadline, root.location, root.new_checkpoint_id)
    recorder = CheckpointRecorder(
        fleet, root, checkpoint_id, deadline, str(trigger), asynchronous, history_bytes
    )
    steps = _checkpoint(
        fleet,
        root,
        deadline,
        checkpoint_id,
        scope,
        controller_state,
        keep,
        keep_closed,
        fix_scope,
        asynchronous,
        recorder.times,
    )
    try:
        # aclosing: a caller that stops iterating closes the steps too, so their abort runs.
        async with contextlib.aclosing(steps):
            async for event in steps:
                recorder.observe(event.phase, event.progress)
                if event.outcome is not None:
                    await recorder.finished(event.outcome)
                yield event
    except Exception as error:
        await recorder.failed(error)
        raise
    except BaseException:
        recorder.interrupted()
        raise


async def _checkpoint(
    fleet: Fleet,
    root: PublicationRoot,
    deadline: float,
    checkpoint_id: str,
    scope: Iterable[EpisodeId] | str | None,
    controller_state: bytes,
    keep: int,
    keep_closed: bool,
    fix_scope: ScopeFixer | None,
    asynchronous: bool,
    times: MemberTimes | None,
) -> AsyncGenerator[CheckpointEvent]:
    """`checkpoint`'s steps, unrecorded but for `times` (each member's commit and, when
    asynchronous, its part found durable; None: not timed, as a benchmark of what the
    history costs runs them)."""
    directory = root.directory(checkpoint_id)
    started = time.monotonic()
    prepared: list[CheckpointOutcome] = []
    async for event in _prepare(fleet, checkpoint_id, deadline, started, prepared, asynchronous):
        yield event
    outcome = prepared[0]
    progress = outcome.progress
    if outcome.prepare_outcome != Outcome.PREPARED:
        return
    mode = {"asynchronous": True} if asynchronous else {}
    try:
        if fix_scope is not None:
            yield CheckpointEvent(Phase.SCOPE, progress)
            fixed, controller_state = await fix_scope(checkpoint_id)
            scope = tuple(fixed)
        yield CheckpointEvent(Phase.COMMIT, progress, detail=dict(mode))
        commit_started = time.monotonic()
        committed = await fanout.commit(
            fleet,
            checkpoint_id,
            deadline,
            str(directory),
            scope,
            asynchronous=asynchronous,
            times=times,
        )
        outcome.commit_seconds = time.monotonic() - commit_started
        if not asynchronous:
            outcome.commit = committed
            async for event in _publish(
                fleet, root, committed, controller_state, keep, outcome, deadline
            ):
                yield event
    except BaseException:
        await _abort(fleet, checkpoint_id, deadline)
        raise
    if not keep_closed:
        yield CheckpointEvent(Phase.RESUME, progress, detail=dict(mode))
        await fanout.resume(fleet, checkpoint_id, max(deadline, time.time() + ABORT_SECONDS))
        outcome.resumed_seconds = time.monotonic() - started
    if asynchronous:
        yield CheckpointEvent(Phase.AWAIT_PARTS, progress, detail={"resumed": not keep_closed})
        durable_started = time.monotonic()
        outcome.commit = await fanout.await_parts(fleet, checkpoint_id, committed, deadline, times)
        outcome.durable_seconds = time.monotonic() - durable_started
        async for event in _publish(
            fleet, root, outcome.commit, controller_state, keep, outcome, deadline
        ):
            yield event
    await _complete_retention(root, outcome, deadline)
    yield CheckpointEvent(Phase.DONE, progress, outcome)


async def _prepare(
    fleet: Fleet,
    checkpoint_id: str,
    deadline: float,
    started: float,
    prepared: list[CheckpointOutcome],
    asynchronous: bool,
) -> AsyncIterator[CheckpointEvent]:
    """The prepare phase both orders share: refuse a fleet awaiting its restore, prepare stage
    by stage (yielding the progress), and abort (resume everyone) unless every member
    prepared, yielding the final event then. The outcome is appended to `prepared` (an
    async generator cannot return it); the caller goes on only when it says PREPARED."""
    progress: FleetProgress | None = None
    await refuse_members_awaiting_restore(fleet)
    try:
        async for progress in fanout.prepare(fleet, checkpoint_id, deadline):
            yield CheckpointEvent(Phase.PREPARE, progress)
    except FleetError as error:
        replaced = {
            name
            for name, failure in error.failures.items()
            if failure.reason == Reason.BOOT_ID_MISMATCH
        }
        await _abort(fleet, checkpoint_id, deadline, sparing=replaced)
        if replaced:
            await _name_replacements_awaiting_restore(fleet)
        raise
    assert progress is not None and progress.outcome is not None
    outcome = CheckpointOutcome(
        checkpoint_id, progress.outcome, progress=progress, asynchronous=asynchronous
    )
    outcome.prepare_seconds = time.monotonic() - started
    prepared.append(outcome)
    if progress.outcome != Outcome.PREPARED:
        await _abort(fleet, checkpoint_id, deadline)
        yield CheckpointEvent(Phase.DONE, progress, outcome)


async def refuse_members_awaiting_restore(fleet: Fleet) -> None:
    """Refuse to checkpoint a fleet in which a member started closed and awaits its restore.

    Such a member is a replacement that holds none of the fleet's state: its part would be
    empty, and publishing it would make `LATEST` forget everything the crashed process held —
    the next recovery would restore the loss. Raises `CheckpointError` INVALID_PHASE with
    metadata `awaitingRestore` (the member names, comma-separated).

    Members that honour the Prepare fence (`Member.prepare_fence`) are asked (GetStatus)
    only while this fleet has not checked their process: a checked process stays checked (it
    has served or been restored, and no process goes back to awaiting a restore), and the
    Prepare is fenced to its boot id, so a replacement is refused there (BOOT_ID_MISMATCH)
    and checked again. At 1,000 members the round was a quarter of a checkpoint's member
    RPCs. A member without the fence (another implementation of the API) would be prepared
    in its replacement's place: it is asked before every checkpoint."""
    unchecked = [m for m in fleet.members if not (m.prepare_fence and m.state_checked_boot_id)]
    if not unchecked:
        return
    statuses = await fanout.fan_out(
        "status", unchecked, lambda m: m.client.get_status(), fleet.spec.fan_out
    )
    waiting = sorted(name for name, status in statuses.items() if awaiting_restore(status))
    for member in unchecked:
        if member.name not in waiting:
            member.state_checked_boot_id = statuses[member.name].boot_id
    if waiting:
        raise CheckpointError(
            Reason.INVALID_PHASE,
            f"member(s) {', '.join(waiting)} started closed and await their restore: "
            "restore or resume them before checkpointing the fleet",
            code="FAILED_PRECONDITION",
            metadata={"awaitingRestore": ",".join(waiting)},
        )


async def _publish(
    fleet: Fleet,
    root: PublicationRoot,
    result: FleetCommit,
    controller_state: bytes,
    keep: int,
    outcome: CheckpointOutcome,
    deadline: float,
) -> AsyncIterator[CheckpointEvent]:
    """Announce (PUBLISH), then publish `outcome`'s checkpoint from every member's durable
    part (in a thread: it verifies every part) and record what was published and continued.
    Retention is left pending for `_complete_retention`, which runs once the fleet runs
    again.

    Bounded by the checkpoint's deadline: a store that hangs is `StorageFailed` then, and the
    publication is abandoned before its next step (`publication.bounded`)."""
    yield CheckpointEvent(
        Phase.PUBLISH,
        outcome.progress,
        detail={"records": result.record_count(), "bytes": result.bytes()},
    )
    publish_started = time.monotonic()
    continued = tuple(sorted(result.scope)) if result.scope is not None else _exported(result)
    parts = [
        PublishedParticipant(
            m.name, m.kind_name, m.instance, result.members[m.name].manifest_sha256
        )
        for m in fleet.members
    ]
    outcome.published = await store_call(
        deadline,
        root.location,
        root.publish,
        outcome.checkpoint_id,
        parts,
        continued,
        controller_state,
        keep=keep,
        defer_retention=True,
    )
    outcome.continued = continued
    outcome.publish_seconds = time.monotonic() - publish_started


async def _complete_retention(
    root: PublicationRoot, outcome: CheckpointOutcome, deadline: float
) -> None:
    """Delete what retention no longer keeps, after the resume: the checkpoint is published
    and the fleet runs, so this costs no pause (at 1,000 members it was seconds of it).

    A failure only leaves old checkpoints behind for the next publication to delete, so it is
    logged, never raised: the caller's checkpoint succeeded. Bounded like the resume before
    it (the deadline, or `ABORT_SECONDS` from now if later): a hung store must not hold the
    caller of a checkpoint that is already published."""
    if outcome.published is None:
        return
    retention_started = time.monotonic()
    bound = max(deadline, time.time() + ABORT_SECONDS)
    try:
        outcome.published = await store_call(
            bound, root.location, root.complete_retention, outcome.published
        )
    except Exception as error:
        log.warning(
            "checkpoint %s is published; deleting older checkpoints failed (%s): the next "
            "publication retries",
            outcome.checkpoint_id,
            error,
        )
    outcome.retention_seconds = time.monotonic() - retention_started


def _exported(result: FleetCommit) -> tuple[EpisodeId, ...]:
    """An unscoped commit continues every episode some member exported."""
    keys = {key for reply in result.members.values() for key in reply.exported}
    return tuple(sorted(EpisodeId.from_capture_key(k) for k in keys))


async def _name_replacements_awaiting_restore(fleet: Fleet) -> None:
    """Members that refused a fenced Prepare are other processes now, no longer checked
    (`fanout._check_again` forgot them): read their status again, so a replacement
    awaiting its restore is named as such (INVALID_PHASE `awaitingRestore`, what a
    supervisor recovers from) rather than as a failed prepare."""
    with contextlib.suppress(FleetError):
        await refuse_members_awaiting_restore(fleet)


async def _abort(
    fleet: Fleet, checkpoint_id: str, deadline: float, *, sparing: Collection[str] = ()
) -> None:
    """Resume everyone so a checkpoint that will not be published never leaves the fleet
    closed; a member that cannot be reached reopens when its lease expires. `sparing`: a
    replacement that refused the Prepare, which a Resume would open before its restore.

    The checkpoint's own failure is what the caller gets; a failed resume here is only logged.
    """
    try:
        await fanout.resume(
            fleet, checkpoint_id, max(deadline, time.time() + ABORT_SECONDS), sparing=sparing
        )
    except FleetError as error:
        log.warning(
            "checkpoint %s aborted; resuming the fleet failed (%s): going on, those members "
            "reopen on their own when their lease expires",
            checkpoint_id,
            error,
        )


@dataclass
class RestoredCheckpoint:
    """A restore done: the published checkpoint it came from, every member's Restore reply (by
    member name), the continued episodes, and the controller state published with it."""

    source_checkpoint_id: str
    """The published checkpoint that was restored."""
    replies: dict[str, object]
    """Every member's Restore reply, by member name."""
    continued: tuple[EpisodeId, ...]
    """The episodes restored to continue (attempt N)."""
    controller_state: bytes
    """The controller state published with the checkpoint."""


@dataclass(frozen=True)
class RestoreSource:
    """A published checkpoint verified whole and matched to the fleet: what to restore."""

    checkpoint_id: str
    directory: str
    continued: tuple[EpisodeId, ...]
    """The episodes to continue (attempt N): the given scope, else the manifest's."""
    controller_state: bytes


async def verified_source(
    fleet: Fleet,
    root: PublicationRoot,
    deadline: float,
    *,
    source: str | None = None,
    scope: Iterable[EpisodeId] | None = None,
) -> RestoreSource:
    """Verify a published checkpoint whole (off the loop, by `deadline`) and check that every
    member has a part in it, before any member installs anything: a torn part or a missing
    member is refused everywhere rather than half installed. `source` None or "LATEST": the
    latest.

    Raises `NoPublishedCheckpoint`, `CheckpointCorrupt`, `StorageFailed` (a store that fails
    or does not answer by the deadline; all `PublicationError`)."""
    summary = await store_call(deadline, root.location, root.inspect, source)
    manifest = summary.manifest
    parts = {(p.kind, p.instance) for p in manifest.participants}
    missing = [m.name for m in fleet.members if (m.kind_name, m.instance) not in parts]
    if missing:
        raise CheckpointCorrupt(
            root.directory(manifest.checkpoint_id),
            f"no part in checkpoint {manifest.checkpoint_id} for member(s) {', '.join(missing)}",
        )
    continued = tuple(sorted(scope)) if scope is not None else manifest.continued
    directory = str(root.directory(manifest.checkpoint_id))
    return RestoreSource(manifest.checkpoint_id, directory, continued, manifest.controller_state)


async def restore_published(
    fleet: Fleet,
    root: PublicationRoot,
    checkpoint_id: str,
    deadline: float,
    *,
    source: str | None = None,
    scope: Iterable[EpisodeId] | None = None,
    rejoin: bool = False,
    trigger: str = Trigger.MANUAL,
) -> RestoredCheckpoint:
    """Verify a published checkpoint whole, then restore it into the fleet, all or nothing.

    `checkpoint_id` is the fresh control id of this restore; `source` names the published
    checkpoint (None or "LATEST": the latest). Every member must have a part in it.
    `rejoin`: restore a fleet whose members may have served, such as the survivors of a
    crash whose crashed member was replaced (`fanout.restore`). The attempt is recorded in
    the root's history (`trigger`: what started it), completed or failed."""
    mode = "rejoin" if rejoin else "fresh"
    recorder = RestoreRecorder(
        fleet, root, checkpoint_id, deadline, str(trigger), mode, source=source or "LATEST"
    )
    try:
        verified = await verified_source(fleet, root, deadline, source=source, scope=scope)
        recorder.source = verified.checkpoint_id
        replies = await fanout.restore(
            fleet,
            checkpoint_id,
            deadline,
            verified.directory,
            verified.continued,
            rejoin=rejoin,
            times=recorder.times,
        )
    except Exception as error:
        await recorder.failed(error)
        raise
    await recorder.completed(len(verified.continued))
    return RestoredCheckpoint(
        verified.checkpoint_id, dict(replies), verified.continued, verified.controller_state
    )
