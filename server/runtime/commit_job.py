"""The commit job: one checkpoint id's export, write and cleanup, outliving any single Commit.

A Commit RPC starts the job (or joins the running one) and waits for it until its own
deadline; the job itself goes on, so a controller's retry awaits the same work. The rules each
prevent a loss:

* Export happens once per checkpoint id. A retry after a failed or slow write stores the same
  records again; re-exporting would store state from after the cut.
* The write runs in a thread and cannot be cancelled, but it goes through a `WriteFence`: a
  Resume stops it, so a checkpoint the controller abandoned never publishes a manifest
  afterwards, and whoever still waits for the job learns, typed (STALE_CHECKPOINT), that the
  checkpoint was resumed.
* A Resume cancels the export step it interrupts, never the job's task (`CommitJob.stop`): a
  task cancelled before its first step ends cancelled without running a line of its body, so
  the Commit awaiting it got a bare CancelledError (an INTERNAL_ERROR) instead of
  STALE_CHECKPOINT when the Resume came right after the job was created.
* Only a running job holds its arguments. A job that failed (a bad directory, a symlink found
  at write time) was never committed, so a retry with a corrected directory must not be
  refused; it inherits the failed job's export when the scope is the same.
* The cleanup (restored episodes the scope leaves out) marks their attempts retired before it
  frees them: the controller restarts such a rollout from its input as a later attempt, and
  without the mark a late request of the dropped attempt could recreate state nothing frees.
* Then the participant releases what the checkpoint no longer needs (`Participant.committed`):
  only once the part is published, so a failed commit releases nothing its retry must export,
  and only once per job, so a replayed commit (its recorded result) changes nothing.
* An asynchronous job (`asynchronous`) stops at the snapshot: the export serialized to bytes
  (in a thread), the cleanup and the release done, the write handed to `PartWrites`. Cleanup
  and release happen at the snapshot, not once durable, because admission may reopen right
  after: a release later would drop state of episodes that started since, outside the scope.
* Every job first waits for a background write still running (`PartWrites.idle`), before it
  exports: at most one snapshot is held, and the memory a checkpoint costs stays bounded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from rollout_checkpoint.server.core.daemon_threads import run_in_daemon_thread
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.layout import PartRecords, StoredManifest
from rollout_checkpoint.server.core.part_storage import (
    CheckpointStorage,
    PublishedPart,
    StopRequested,
    WriteFence,
)
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.collector import collection_paused
from rollout_checkpoint.server.runtime.part_chain import (
    Identity,
    PartChains,
    PartPlan,
    exported_keys,
)
from rollout_checkpoint.server.runtime.part_writes import PartSnapshot, PartWrites
from rollout_checkpoint.server.runtime.participant import (
    ExportRecord,
    Participant,
    UnchangedRecord,
)
from rollout_checkpoint.server.runtime.parts import ControlParts
from rollout_checkpoint.server.runtime.records_codec import serialize_records
from rollout_checkpoint.server.runtime.refusals import call_hook, conflict, stale
from rollout_checkpoint.server.runtime.waiting import retrieve_exception

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a Commit published: the part's manifest and its digest, its records (written,
    referenced), the episodes exported and the attempts retired with it. An asynchronous
    commit answers at the snapshot: no manifest yet (`manifest` None), the snapshot's size
    instead, and the records the durable part will hold (known at the cut)."""

    manifest: StoredManifest | None
    manifest_sha256: str
    exported: tuple[str, ...]
    retired: tuple[str, ...]
    records: PartRecords
    snapshot_bytes: int = 0

    @property
    def snapshot_records(self) -> int:
        """Every record the snapshot cut, written or referenced (0 for a synchronous commit,
        whose `manifest` says it)."""
        return 0 if self.manifest is not None else self.records.record_count

    @property
    def snapshot_only(self) -> bool:
        return self.manifest is None


class CommitHost(ControlParts, Protocol):
    """What a commit job works with besides: the control plane's storage and marks."""

    @property
    def storage(self) -> CheckpointStorage: ...

    @property
    def part_writes(self) -> PartWrites: ...

    @property
    def part_chains(self) -> PartChains: ...

    @property
    def retired_attempts(self) -> RetiredAttempts: ...

    def changed(self) -> None: ...

    def part_published(
        self, checkpoint_dir: str, part: PublishedPart, asynchronous: bool, generation: int
    ) -> None:
        """Note the last part this process published (GetStatus's `last_part`), cut in
        restore `generation`."""
        ...


@dataclass(eq=False)
class CommitJob:
    """One checkpoint id's export, write and cleanup; outlives any single Commit call.

    `phase` (export, write, cleanup, done) tells a Resume what stopping it means: an export is
    cancelled, a write fenced off, a cleanup waited for (`stop`)."""

    checkpoint_id: str
    checkpoint_dir: str
    scope: frozenset[EpisodeId] | None
    asynchronous: bool = False
    records: Sequence[ExportRecord | UnchangedRecord] | None = None
    plan: PartPlan | None = None
    """An incremental participant's part: its own records and references (None: full)."""
    snapshot: PartSnapshot | None = None
    phase: str = "export"
    published: PublishedPart | None = None
    retired: tuple[str, ...] | None = None
    fence: WriteFence = field(default_factory=WriteFence)
    task: asyncio.Task[CommitResult] | None = None
    export_step: asyncio.Future[Any] | None = None
    """The export (or snapshot) under way: what a Resume cancels (`stop`)."""

    @property
    def args(self) -> tuple[str, frozenset[EpisodeId] | None, bool]:
        return (self.checkpoint_dir, self.scope, self.asynchronous)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, host: CommitHost) -> asyncio.Task[CommitResult]:
        """The job's task, started once (on the running loop) and kept until it ends."""
        if not self.running:
            self.task = asyncio.get_running_loop().create_task(self._run(host))
            self.task.add_done_callback(retrieve_exception)
        assert self.task is not None
        return self.task

    def stop(self) -> bool:
        """A Resume's stop: fence the write off and cancel the export under way (nothing will
        use it). Returns whether the write is already publishing (it cannot be withdrawn).

        The job's own task is never cancelled: one cancelled before its first step would end
        cancelled without running `_run`, and the Commit awaiting it would get a bare
        CancelledError, not STALE_CHECKPOINT. The job checks the fence before each step
        instead, so a job stopped before it ran ends, typed, without exporting anything."""
        publishing = self.fence.stop()
        if self.export_step is not None:
            self.export_step.cancel()
        return publishing

    async def _run(self, host: CommitHost) -> CommitResult:
        """Export (once), write (until published), then retire what the scope leaves out.

        A Resume stops the job through its fence (and cancels an export nothing will use);
        whoever still waits for it then learns, typed, that the checkpoint was resumed. A
        cancellation of the job's own task (the loop closing) is not a Resume's and
        propagates."""
        try:
            return await self._phases(host)
        except StopRequested:
            raise stale(self.checkpoint_id) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.fence.stopped and (task is None or not task.cancelling()):
                raise stale(self.checkpoint_id) from None
            raise

    async def _export_step(self, step: Callable[[], Awaitable[T]]) -> T:
        """Run `step` (an export or a snapshot) as the step a Resume cancels (`stop`).

        The fence is checked on both sides: a job stopped before the step exports nothing
        more, and a Resume that came once the step had ended (there was nothing left to
        cancel) must still keep an asynchronous job from its cleanup, its release and a
        background write of the abandoned checkpoint."""
        self.fence.check()
        running: asyncio.Future[T] = asyncio.ensure_future(step())
        self.export_step = running
        try:
            result = await running
        finally:
            self.export_step = None
        self.fence.check()
        return result

    async def _phases(self, host: CommitHost) -> CommitResult:
        if self.records is None:
            self.phase = "export"
            exported, self.plan = await self._export_step(
                lambda: _export(host, self.scope, self.checkpoint_dir)
            )
            self.records = exported
        records = self.records
        if self.asynchronous:
            return await self._snapshot_phases(host, records)
        if self.published is None:
            self.phase = "write"
            self.fence.check()
            with host.observer.phase("write"):
                self.published = await self._write(host, records)
        if self.retired is None:
            self.phase = "cleanup"
            retired = await _retire_unscoped_pending(host, self.scope)
            _release_committed(host, self.checkpoint_id, self.scope)
            self.retired = retired
        # Only now: a Commit whose cleanup fails is a failed Commit, whose part no status
        # may show as the last published (the asynchronous job starts its write only here).
        host.part_published(
            self.checkpoint_dir,
            self.published,
            asynchronous=False,
            generation=host.part_chains.generation,
        )
        self.phase = "done"
        return CommitResult(
            manifest=self.published.manifest,
            manifest_sha256=self.published.manifest_sha256,
            exported=self._exported(records),
            retired=self.retired,
            records=self.published.manifest.records,
        )

    def _exported(self, records: Sequence[ExportRecord | UnchangedRecord]) -> tuple[str, ...]:
        return exported_keys(records) if self.plan is None else self.plan.exported_keys()

    async def _write(
        self, host: CommitHost, records: Sequence[ExportRecord | UnchangedRecord]
    ) -> PublishedPart:
        """Write the part in a thread; an incremental part becomes the base of the next one
        once published (never before: a failed write leaves its records changed)."""
        participant = host.participant
        plan = self.plan
        name = f"part write {self.checkpoint_id}"
        if plan is None:
            write = functools.partial(
                host.storage.write_part,
                self.checkpoint_dir,
                participant.kind.value,
                participant.instance,
                self.checkpoint_id,
                _serialized_lines(records),
                self.fence,
            )
            return await run_in_daemon_thread(write, name)
        try:
            published = await run_in_daemon_thread(
                functools.partial(
                    plan.write,
                    host.storage,
                    participant.kind.value,
                    participant.instance,
                    self.checkpoint_id,
                    self.fence,
                ),
                name,
            )
        except BaseException:
            host.part_chains.settled(plan, None)
            raise
        host.part_chains.settled(plan, published)
        return published

    async def _snapshot_phases(
        self, host: CommitHost, records: Sequence[ExportRecord | UnchangedRecord]
    ) -> CommitResult:
        """The asynchronous job: snapshot, cleanup and release, then the write handed off.

        The snapshot is serialized in a thread (a large export must not stall the loop) and
        counts as the export for a Resume (cancelled: nothing will use it). The write starts
        only once the cleanup succeeded, so a failed commit never leaves a part writing."""
        participant = host.participant
        if self.snapshot is None:
            self.phase = "export"
            self.snapshot = await self._export_step(lambda: _snapshot(host, records, self.plan))
        if self.retired is None:
            self.phase = "cleanup"
            retired = await _retire_unscoped_pending(host, self.scope)
            _release_committed(host, self.checkpoint_id, self.scope)
            self.retired = retired
            host.part_writes.start(
                self.checkpoint_id,
                self.checkpoint_dir,
                participant.kind.value,
                participant.instance,
                self.snapshot,
                host.part_chains.generation,
            )
        self.phase = "done"
        return CommitResult(
            manifest=None,
            manifest_sha256="",
            exported=self._exported(records),
            retired=self.retired,
            records=self.snapshot.records,
            snapshot_bytes=self.snapshot.size,
        )


async def _export(
    host: CommitHost, scope: frozenset[EpisodeId] | None, checkpoint_dir: str
) -> tuple[Sequence[ExportRecord | UnchangedRecord], PartPlan | None]:
    """The participant's export, once the background write still running ended
    (`PartWrites.idle`: at most one snapshot held, and the part it wrote is the base).

    An incremental participant exports what changed since the base part (`part_chain`);
    the change clock is read before its export starts, so a change during the export
    leaves its record changed for the next commit."""
    previous_write = host.part_writes.idle()
    if previous_write is not None:
        await previous_write
    participant = host.participant
    # The export allocates a record per episode beside the participant's whole live state,
    # which a full collection would rescan for nothing (collector.py).
    with host.observer.phase("export"), collection_paused():
        if not participant.incremental:
            return await call_hook("export", participant.export(scope)), None
        chains = host.part_chains
        base = chains.base_for(checkpoint_dir)
        cut = participant.change_clock()
        changes = await call_hook("export", participant.export_changes(scope, base))
    plan = chains.plan(checkpoint_dir, cut, changes, base, _identity_of(participant), scope is None)
    return changes.items, plan


def _identity_of(participant: Participant) -> Identity:
    def identity(record: ExportRecord) -> Hashable:
        return participant.record_identity(record.episode_id, record.fields)

    return identity


async def _snapshot(
    host: CommitHost,
    records: Sequence[ExportRecord | UnchangedRecord],
    plan: PartPlan | None,
) -> PartSnapshot:
    """The export serialized to bytes, in a thread (a large export must not stall the loop).
    An incremental part's snapshot is its own records only: the unchanged ones are fixed in
    published parts already, so their reference lines are the write's work, not the pause's
    (`PartPlan.write`); the part becomes the base once durable (`PartSnapshot.settled`)."""
    with host.observer.phase("snapshot"):
        if plan is None:
            return PartSnapshot(await asyncio.to_thread(_serialized, records))
        own = await asyncio.to_thread(plan.encode_own)
        return PartSnapshot(
            own, plan=plan, settled=functools.partial(host.part_chains.settled, plan)
        )


def _serialized(records: Sequence[ExportRecord | UnchangedRecord]) -> tuple[bytes, ...]:
    return tuple(_serialized_lines(records))


def _serialized_lines(records: Sequence[ExportRecord | UnchangedRecord]) -> Iterator[bytes]:
    """A full export's lines: without a plan every record is an `ExportRecord`."""
    return serialize_records(cast(Sequence[ExportRecord], records))


def commit_job_for(
    current: CommitJob | None,
    checkpoint_id: str,
    real_dir: str,
    scope: frozenset[EpisodeId] | None,
    asynchronous: bool = False,
) -> CommitJob:
    """The job a Commit of these arguments joins: `current` when its arguments are the same,
    else a new one.

    Raises CHECKPOINT_CONFLICT while a job of this id with other arguments runs. A job that
    failed holds no arguments (it was never committed): the new job replaces it, inheriting
    its export when the scope is the same, since exporting again could store state from after
    the cut.
    """
    if current is None or current.checkpoint_id != checkpoint_id:
        return CommitJob(checkpoint_id, real_dir, scope, asynchronous)
    if current.args == (real_dir, scope, asynchronous):
        return current
    if current.running:
        raise conflict(
            checkpoint_id,
            None,
            "a commit of this id with another directory or scope is under way",
        )
    if current.scope != scope or current.records is None:
        return CommitJob(checkpoint_id, real_dir, scope, asynchronous)
    plan = current.plan.moved_to(real_dir) if current.plan is not None else None
    return CommitJob(
        checkpoint_id, real_dir, scope, asynchronous, records=current.records, plan=plan
    )


def _release_committed(
    host: CommitHost, checkpoint_id: str, scope: frozenset[EpisodeId] | None
) -> None:
    """Let the participant release what the published part no longer needs. A failure is
    logged and kept from the commit: the part is published, and the state stays until the
    next commit releases it."""
    try:
        host.participant.committed(scope)
    except Exception:
        log.exception(
            "checkpoint %s: releasing state after the commit failed",
            checkpoint_id,
            extra={"checkpoint_id": checkpoint_id},
        )
    host.changed()


async def _retire_unscoped_pending(
    host: CommitHost, scope: frozenset[EpisodeId] | None
) -> tuple[str, ...]:
    """Free restored state that the controller no longer continues, and refuse its attempt.

    The controller will restart such a rollout from its input as a later attempt; without
    the mark a late request of the dropped attempt could recreate state nothing frees.
    """
    if scope is None:
        return ()
    participant = host.participant
    dropped = sorted(participant.restored_pending() - scope)
    for episode in dropped:
        host.retired_attempts.mark(episode)
    host.changed()
    for episode in dropped:
        await call_hook("retire", participant.retire(episode))
    return tuple(e.capture_key for e in dropped)
