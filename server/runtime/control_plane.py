"""The participant control plane: states, fencing, lease, deadlines, idempotent replay, storage.

One ControlPlane wraps one Participant. It knows nothing of gRPC or HTTP: the sidecar turns
RPCs into calls here and `CheckpointError`s into statuses.

The rules below each prevent a specific loss:

* One lock serializes transitions, but Prepare's wait for readiness, the export and write of
  a Commit and the install of a Restore run outside it, so a Resume can always interrupt them.
* A completed Prepare, Commit or Restore is recorded with its arguments and consulted before
  the state check: a controller that lost a reply and retries gets the same answer instead of
  INVALID_PHASE, and a retry with other arguments is a conflict rather than a silent redo.
* A Commit exports once per checkpoint id. A retry after a failed or slow write stores the
  same records again; re-exporting would store state from after the cut.
* The write cannot be cancelled (a thread), but a Resume sets its stop flag so a checkpoint
  the controller abandoned never publishes a manifest afterwards.
* The lease turns a dead controller into a Resume: the fleet never stays closed forever.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import enum
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.clock import Clock, SystemClock
from rollout_checkpoint.server.core.episodes import (
    MAX_ATTEMPT,
    EpisodeId,
    is_valid_id,
    rollout_id_problem,
)
from rollout_checkpoint.server.core.errors import (
    CheckpointError,
    Reason,
    corrupt_checkpoint,
    deadline_exceeded,
    invalid_phase,
    invalid_request,
    rejected_checkpoint,
)
from rollout_checkpoint.server.core.layout import StoredManifest
from rollout_checkpoint.server.core.part_storage import (
    CheckpointStorage,
    LocalStorage,
    PublishedPart,
    StopRequested,
    WriteFence,
    validate_checkpoint_dir,
)
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.observe import ControlObserver
from rollout_checkpoint.server.runtime.participant import (
    EpisodeInfo,
    ExportRecord,
    Participant,
    ReadinessReport,
    RestoredRecord,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

RESUMED_IDS_KEPT = 64
COALESCE_SECONDS = 0.02
LEASE_RETRY_SECONDS = 30.0
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 500


class State(enum.StrEnum):
    IDLE = "IDLE"
    PREPARING = "PREPARING"
    PREPARED = "PREPARED"
    COMMITTED = "COMMITTED"
    RESTORED = "RESTORED"


OPEN_CHECKPOINT = frozenset({State.PREPARING, State.PREPARED, State.COMMITTED})


class UpdateKind(enum.StrEnum):
    INITIAL = "INITIAL"
    CHANGE = "CHANGE"
    HEARTBEAT = "HEARTBEAT"
    FINAL = "FINAL"


@dataclass(frozen=True, slots=True)
class ControlSettings:
    lease_grace_seconds: float = 600.0
    heartbeat_seconds: float = 1.0
    max_deadline_seconds: float = 86400.0
    allowed_checkpoint_roots: tuple[str, ...] = ()
    start_closed: bool = False
    start_closed_timeout_seconds: float | None = None
    readiness_pause_threshold_seconds: float = 30.0


@dataclass(frozen=True, slots=True)
class PrepareUpdate:
    state: State
    checkpoint_id: str
    report: ReadinessReport
    lease_expires_at: float | None
    sequence: int
    elapsed: float
    kind: UpdateKind
    replayed: bool
    admission_open: bool

    @property
    def final(self) -> bool:
        return self.kind is UpdateKind.FINAL


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a Commit published: the part's manifest and its digest, the episodes exported
    and the attempts retired with it."""

    manifest: StoredManifest
    manifest_sha256: str
    exported: tuple[str, ...]
    retired: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What a Restore installed: from which checkpoint, and the capture keys restored."""

    source_checkpoint_id: str
    restored: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    state: State
    checkpoint_id: str
    lease_expires_at: float | None
    admission_open: bool
    report: ReadinessReport
    retired_rollouts: int
    restored_pending: int
    facts: dict[str, str]
    counters: dict[str, int]


class _Recorded(NamedTuple):
    """A completed call's arguments and result, replayed to a retry of the same call (a
    retry with other arguments is a conflict, not a replay)."""

    args: object
    result: object


@dataclass(eq=False)
class _CommitJob:
    """One checkpoint id's export, write and cleanup; outlives any single Commit call."""

    checkpoint_id: str
    checkpoint_dir: str
    scope: frozenset[EpisodeId] | None
    records: Sequence[ExportRecord] | None = None
    phase: str = "export"
    published: PublishedPart | None = None
    retired: tuple[str, ...] | None = None
    fence: WriteFence = field(default_factory=WriteFence)
    task: asyncio.Task[CommitResult] | None = None

    @property
    def args(self) -> tuple[str, frozenset[EpisodeId] | None]:
        return (self.checkpoint_dir, self.scope)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass(eq=False)
class _RestoreJob:
    checkpoint_id: str
    checkpoint_dir: str
    scope: frozenset[EpisodeId]
    deadline: float
    phase: str = "read"
    """read (nothing installed: a Resume may abandon it), install, undo, done."""
    task: asyncio.Task[RestoreResult] | None = None

    @property
    def args(self) -> tuple[str, frozenset[EpisodeId]]:
        return (self.checkpoint_dir, self.scope)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class ControlPlane:
    """The checkpoint state machine of one participant process."""

    def __init__(
        self,
        participant: Participant,
        settings: ControlSettings | None = None,
        *,
        storage: CheckpointStorage | None = None,
        clock: Clock | None = None,
        observer: ControlObserver | None = None,
    ) -> None:
        if not is_valid_id(participant.instance) or participant.instance in (".", ".."):
            raise ValueError(f"participant instance {participant.instance!r} is not a valid name")
        self.participant = participant
        self.settings = settings or ControlSettings()
        self.storage: CheckpointStorage = storage or LocalStorage()
        self.clock: Clock = clock or SystemClock()
        self.retired_attempts = RetiredAttempts()
        self._lock = asyncio.Lock()
        self._state = State.IDLE
        self._active_id: str | None = None
        self._lease_expires_at: float | None = None
        self._resumed: OrderedDict[str, None] = OrderedDict()
        self._resuming: set[str] = set()
        """Ids whose Resume waits (outside the lock) for a stopped job to end: fenced like
        resumed ids, so no call can start new work for them in the meantime."""
        self._results: dict[tuple[str, str], _Recorded] = {}
        self._commit_job: _CommitJob | None = None
        self._restore_job: _RestoreJob | None = None
        self._admission_open = True
        self._closed_since: float | None = None
        self._start_closed_pending = False
        self._shutting_down = False
        self._retires_running: dict[str, int] = {}
        self._retires_cut_short: set[str] = set()
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self._fatal_listeners: list[Callable[[BaseException], None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._lease_task: asyncio.Task[None] | None = None
        participant.attach(self)
        self.observer = observer or ControlObserver()
        self.observer.attach(self)

    # -- ParticipantContext -------------------------------------------------------------

    @property
    def retired(self) -> RetiredAttempts:
        return self.retired_attempts

    def changed(self) -> None:
        """Wake every waiter: readiness, state or admission may have changed."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        for listener in list(self._listeners):
            listener()

    # -- lifecycle ----------------------------------------------------------------------

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.remove(listener)

    def add_fatal_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Called when a background duty (the lease watcher, a timer) dies unexpectedly.

        A participant whose lease can no longer expire could leave the fleet closed forever,
        so such a failure is what liveness reports: the pod gets restarted."""
        self._fatal_listeners.append(listener)

    async def start(self) -> None:
        """Called once on the server's loop before any traffic.

        With `start_closed`, admission starts closed so a replacement process serves nothing
        before the controller's Restore (which a process that served anything must refuse).
        """
        if self.settings.start_closed:
            self._start_closed_pending = True
            self._close_admission()
            timeout = self.settings.start_closed_timeout_seconds
            if timeout is None:
                timeout = self.settings.lease_grace_seconds
            self._spawn(self._open_after_start_closed(self.clock.now() + timeout))

    async def begin_shutdown(self) -> None:
        """Refuse changes from now on (SHUTTING_DOWN); reads keep working."""
        self._shutting_down = True
        self.participant.shutting_down_now()
        self.changed()

    async def close(self) -> None:
        """Stop background tasks (lease watcher, timers). Writes already running finish."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- read-only views ----------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def active_checkpoint_id(self) -> str | None:
        return self._active_id

    @property
    def admission_open(self) -> bool:
        return self._admission_open

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def start_closed_pending(self) -> bool:
        return self._start_closed_pending

    @property
    def lease_expires_at(self) -> float | None:
        return self._lease_expires_at

    def readiness_serving(self) -> bool:
        """The `participant-readiness` health answer: should new HTTP traffic come here?

        Not before a `start_closed` process is resumed, not while RESTORED (the restored
        state is not live until Resume), and not for a pause longer than the threshold;
        a short checkpoint pause keeps the pod in its Service so clients see no churn.
        """
        if self._shutting_down or self._start_closed_pending or self._state is State.RESTORED:
            return False
        if self._admission_open or self._closed_since is None:
            return True
        paused = self.clock.now() - self._closed_since
        return paused < self.settings.readiness_pause_threshold_seconds

    def readiness_changes_at(self) -> float | None:
        """When `readiness_serving` flips without any event (a pause crossing the threshold)."""
        if self._admission_open or self._closed_since is None:
            return None
        return self._closed_since + self.settings.readiness_pause_threshold_seconds

    def status(self) -> StatusSnapshot:
        return StatusSnapshot(
            state=self._state,
            checkpoint_id=self._active_id or "",
            lease_expires_at=self._lease_expires_at,
            admission_open=self._admission_open,
            report=self.participant.report(),
            retired_rollouts=len(self.retired_attempts),
            restored_pending=len(self.participant.restored_pending()),
            facts=dict(self.participant.facts()),
            counters=dict(self.participant.counters()),
        )

    def list_episodes(self, page_size: int, page_token: str) -> tuple[list[EpisodeInfo], str]:
        if page_size < 0:
            raise invalid_request("page_size", "must not be negative")
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = _decode_page_token(page_token) if page_token else None
        episodes = sorted(self.participant.episodes(), key=lambda e: e.episode_id.capture_key)
        if after is not None:
            episodes = [e for e in episodes if e.episode_id.capture_key > after]
        page = episodes[:size]
        more = len(episodes) > size
        token = _encode_page_token(page[-1].episode_id.capture_key) if more and page else ""
        return page, token

    # -- Prepare ------------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline: float) -> AsyncIterator[PrepareUpdate]:
        """Close admission and yield progress until ready, the deadline, or the end.

        Checks and the transition happen before the first message, so a refusal surfaces
        as an error of the call rather than mid-stream.
        """
        started = self.clock.now()
        self._check_id(checkpoint_id)
        self._check_deadline(deadline)
        async with self._lock:
            self._check_not_shutting_down()
            replayed = (checkpoint_id, "prepare") in self._results
            if not replayed:
                self._fence(checkpoint_id, "Prepare", {State.IDLE, State.PREPARING, State.PREPARED})
                if self._state is State.IDLE:
                    self._begin_prepare(checkpoint_id, deadline)
                else:
                    self._renew(deadline)
        return self._prepare_stream(checkpoint_id, deadline, started, replayed)

    def _begin_prepare(self, checkpoint_id: str, deadline: float) -> None:
        if self._restore_job is not None:
            raise CheckpointError(
                Reason.CHECKPOINT_CONFLICT,
                "a restore is under way",
                metadata={
                    "checkpointId": checkpoint_id,
                    "activeCheckpointId": self._restore_job.checkpoint_id,
                },
            )
        self._active_id = checkpoint_id
        self._state = State.PREPARING
        self._renew(deadline)
        try:
            self._close_admission()
        except Exception as exc:
            # State and admission must never disagree: undo the whole transition.
            self._state = State.IDLE
            self._active_id = None
            self._lease_expires_at = None
            with contextlib.suppress(Exception):
                self._open_admission()
            self.changed()
            raise _hook_failed("close_admission", exc) from exc
        self.changed()

    async def _prepare_stream(
        self, checkpoint_id: str, deadline: float, started: float, replayed: bool
    ) -> AsyncIterator[PrepareUpdate]:
        sequence = 0

        def update(kind: UpdateKind, report: ReadinessReport | None = None) -> PrepareUpdate:
            nonlocal sequence
            sequence += 1
            return PrepareUpdate(
                state=self._state,
                checkpoint_id=self._active_id or "",
                report=report or self.participant.report(),
                lease_expires_at=self._lease_expires_at,
                sequence=sequence,
                elapsed=max(0.0, self.clock.now() - started),
                kind=kind,
                replayed=replayed,
                admission_open=self._admission_open,
            )

        if replayed:
            yield update(UpdateKind.FINAL)
            return
        loop = asyncio.get_running_loop()
        last = update(UpdateKind.INITIAL)
        yield last
        last_sent_at = loop.time()
        next_heartbeat = self.clock.now() + self.settings.heartbeat_seconds
        change_pending = False
        while True:
            wake = self._changed
            if self._active_id != checkpoint_id or self._state is not State.PREPARING:
                break
            if self.participant.ready():
                await self._mark_prepared(checkpoint_id)
                continue
            now = self.clock.now()
            if now >= deadline:
                break
            if change_pending and loop.time() - last_sent_at >= COALESCE_SECONDS:
                change_pending = False
                report = self.participant.report()
                if _report_differs(report, last.report):
                    last = update(UpdateKind.CHANGE, report)
                    last_sent_at = loop.time()
                    yield last
                    continue
            if now >= next_heartbeat:
                last = update(UpdateKind.HEARTBEAT)
                last_sent_at = loop.time()
                next_heartbeat = now + self.settings.heartbeat_seconds
                yield last
                continue
            waits: list[Awaitable[Any]] = [
                wake.wait(),
                self.clock.sleep_until(min(deadline, next_heartbeat)),
            ]
            if change_pending:
                waits.append(asyncio.sleep(COALESCE_SECONDS - (loop.time() - last_sent_at)))
            if await _first_of(waits) == 0:
                change_pending = True
        ended_in = self._state if self._active_id == checkpoint_id else State.IDLE
        self.observer.prepare_ended(ended_in.value)
        yield update(UpdateKind.FINAL)

    async def _mark_prepared(self, checkpoint_id: str) -> None:
        async with self._lock:
            if (
                self._active_id == checkpoint_id
                and self._state is State.PREPARING
                and self.participant.ready()
            ):
                self._state = State.PREPARED
                self._results[(checkpoint_id, "prepare")] = _Recorded((), None)
                if self._closed_since is not None:
                    self.observer.drained(self.clock.now() - self._closed_since)
                self.changed()

    # -- Renew --------------------------------------------------------------------------

    async def renew(self, checkpoint_id: str, deadline: float) -> float:
        self._check_id(checkpoint_id)
        self._check_deadline(deadline)
        async with self._lock:
            self._check_not_shutting_down()
            self._fence(
                checkpoint_id,
                "Renew",
                {State.PREPARING, State.PREPARED, State.COMMITTED, State.RESTORED},
            )
            return self._renew(deadline)

    # -- Commit -------------------------------------------------------------------------

    async def commit(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        scope: frozenset[EpisodeId] | None,
    ) -> CommitResult:
        self._check_id(checkpoint_id)
        self._check_deadline(deadline)
        real_dir = await self._validated_dir(checkpoint_dir, deadline)
        args = (real_dir, scope)
        async with self._lock:
            self._check_not_shutting_down()
            recorded = self._replay(checkpoint_id, "commit", args)
            if recorded is not None:
                assert isinstance(recorded, CommitResult)
                return recorded
            self._fence(checkpoint_id, "Commit", {State.PREPARED})
            job = self._commit_job_for(checkpoint_id, real_dir, scope)
            self._renew(deadline)
            if not self.participant.ready():
                raise invalid_phase(self._state, "Commit", "the participant is no longer ready")
            if scope is None and self.participant.requires_scope:
                raise CheckpointError(
                    Reason.SCOPE_REQUIRED, "this participant needs an explicit commit scope"
                )
            self._commit_job = job
            if not job.running:
                job.task = asyncio.get_running_loop().create_task(self._run_commit(job))
                job.task.add_done_callback(_retrieve_exception)
            assert job.task is not None
            task = job.task
        result = await self._await_until(
            deadline, task, "the commit did not finish before its deadline"
        )
        async with self._lock:
            recorded = self._results.get((checkpoint_id, "commit"))
            if recorded is not None:
                assert isinstance(recorded.result, CommitResult)
                return recorded.result
            self._fence(checkpoint_id, "Commit", {State.PREPARED})
            self._state = State.COMMITTED
            self._results[(checkpoint_id, "commit")] = _Recorded(args, result)
            self.observer.committed(result.manifest.record_count, result.manifest.bytes)
            self.changed()
            return result

    def _commit_job_for(
        self, checkpoint_id: str, real_dir: str, scope: frozenset[EpisodeId] | None
    ) -> _CommitJob:
        """The job a Commit of these arguments joins: the job of the same arguments, or a new
        one.

        Only a running job holds its arguments: a job that failed (a bad directory, a symlink
        found at write time) was never committed, so a retry with a corrected directory must
        not be refused. It inherits the failed job's export when the scope is the same:
        export happens once per checkpoint id, and exporting again could store state from
        after the cut.
        """
        job = self._commit_job
        if job is None or job.checkpoint_id != checkpoint_id:
            return _CommitJob(checkpoint_id, real_dir, scope)
        if job.args == (real_dir, scope):
            return job
        if job.running:
            raise _conflict(
                checkpoint_id,
                None,
                "a commit of this id with another directory or scope is under way",
            )
        return _CommitJob(
            checkpoint_id, real_dir, scope, records=job.records if job.scope == scope else None
        )

    async def _validated_dir(self, checkpoint_dir: str, deadline: float) -> str:
        """The checkpoint directory's real path, checked off the loop within the deadline
        (a hung filesystem must cost the call its deadline, not the participant its loop)."""
        check = asyncio.ensure_future(
            asyncio.to_thread(
                validate_checkpoint_dir, checkpoint_dir, self.settings.allowed_checkpoint_roots
            )
        )
        check.add_done_callback(_retrieve_exception)
        return await self._await_until(
            deadline, check, "the checkpoint directory could not be checked before the deadline"
        )

    async def _run_commit(self, job: _CommitJob) -> CommitResult:
        """Export (once), write (until published), then retire what the scope leaves out.

        A Resume stops the job through its fence (and cancels an export nothing will use);
        whoever still waits for it then learns, typed, that the checkpoint was resumed."""
        try:
            return await self._commit_phases(job)
        except StopRequested:
            raise _stale(job.checkpoint_id) from None
        except asyncio.CancelledError:
            if job.fence.stopped:
                raise _stale(job.checkpoint_id) from None
            raise

    async def _commit_phases(self, job: _CommitJob) -> CommitResult:
        if job.records is None:
            job.phase = "export"
            with self.observer.phase("export"):
                job.records = await _call_hook("export", self.participant.export(job.scope))
        if job.published is None:
            job.phase = "write"
            job.fence.check()
            lines = _serialize_records(job.records)
            with self.observer.phase("write"):
                job.published = await asyncio.to_thread(
                    self.storage.write_part,
                    job.checkpoint_dir,
                    self.participant.kind.value,
                    self.participant.instance,
                    job.checkpoint_id,
                    lines,
                    job.fence,
                )
        if job.retired is None:
            job.phase = "cleanup"
            job.retired = await self._retire_unscoped_pending(job.scope)
        job.phase = "done"
        return CommitResult(
            manifest=job.published.manifest,
            manifest_sha256=job.published.manifest_sha256,
            exported=tuple(sorted({r.episode_id.capture_key for r in job.records})),
            retired=job.retired,
        )

    async def _retire_unscoped_pending(self, scope: frozenset[EpisodeId] | None) -> tuple[str, ...]:
        """Free restored state that the controller no longer continues, and refuse its attempt.

        The controller will restart such a rollout from its input as a later attempt; without
        the mark a late request of the dropped attempt could recreate state nothing frees.
        """
        if scope is None:
            return ()
        dropped = sorted(self.participant.restored_pending() - scope)
        for episode in dropped:
            self.retired_attempts.mark(episode)
        self.changed()
        for episode in dropped:
            await _call_hook("retire", self.participant.retire(episode))
        return tuple(e.capture_key for e in dropped)

    # -- Restore ------------------------------------------------------------------------

    async def restore(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        scope: frozenset[EpisodeId],
    ) -> RestoreResult:
        self._check_id(checkpoint_id)
        self._check_deadline(deadline)
        real_dir = await self._validated_dir(checkpoint_dir, deadline)
        args = (real_dir, scope)
        async with self._lock:
            self._check_not_shutting_down()
            recorded = self._replay(checkpoint_id, "restore", args)
            if recorded is not None:
                assert isinstance(recorded, RestoreResult)
                return recorded
            self._fence(checkpoint_id, "Restore", {State.IDLE})
            job = self._restore_job
            if job is not None:
                if job.checkpoint_id != checkpoint_id or job.args != args:
                    raise _conflict(
                        checkpoint_id, job.checkpoint_id, "another restore is under way"
                    )
                job.deadline = max(job.deadline, deadline)
            else:
                if self.participant.has_served():
                    raise CheckpointError(
                        Reason.FRESH_PROCESS_REQUIRED,
                        "this process has already served sessions or episodes; restore into a fresh one",
                    )
                job = _RestoreJob(checkpoint_id, real_dir, scope, deadline)
                job.task = asyncio.get_running_loop().create_task(self._run_restore(job))
                job.task.add_done_callback(_retrieve_exception)
                self._restore_job = job
            assert job.task is not None
            task = job.task
        return await self._await_until(
            deadline, task, "the restore did not finish before its deadline"
        )

    async def _run_restore(self, job: _RestoreJob) -> RestoreResult:
        """Read and verify off the loop, install all or nothing, then RESTORED (closed).

        On any failure nothing stays installed: an install that outlived the deadline (or
        whose restore was resumed meanwhile) is never interrupted — a half-installed set is
        the one outcome that must not exist — but once it ends its attempt N+1 episodes are
        freed again through the participant before admission reopens. The process stays
        fresh, so a retry of the same restore works. The read is bounded by the deadline:
        storage that hangs costs this restore, not every later one.
        """
        closed_here = False
        records: list[RestoredRecord] = []
        installed = False
        try:
            reading = asyncio.ensure_future(asyncio.to_thread(self._read_selected, job))
            reading.add_done_callback(_retrieve_exception)
            with self.observer.phase("read"):
                manifest, raw = await self._await_until(
                    job.deadline, reading, "the restore's read did not finish before its deadline"
                )
            records = [_restored_record(r) for r in raw]
            async with self._lock:
                self._check_restore_alive(job, "read")
                job.phase = "install"
                self._close_admission()
                closed_here = True
                self.changed()
            with self.observer.phase("install"):
                await _call_hook("install", self.participant.install(records))
            installed = True
            async with self._lock:
                self._check_restore_alive(job, "install")
                # A late request of the crashed attempt must never change the restored state.
                for record in records:
                    self.retired_attempts.mark(record.checkpointed)
                result = RestoreResult(
                    source_checkpoint_id=manifest.checkpoint_id,
                    restored=tuple(sorted({r.restored_as.capture_key for r in records})),
                )
                self._state = State.RESTORED
                self._active_id = job.checkpoint_id
                self._renew(job.deadline)
                self._results[(job.checkpoint_id, "restore")] = _Recorded(job.args, result)
                self.observer.restored(len(records), manifest.bytes)
                job.phase = "done"
                self.changed()
                return result
        except BaseException:
            if installed:
                job.phase = "undo"
                await self._undo_install(job, records)
            async with self._lock:
                if closed_here and self._state is State.IDLE and not self._start_closed_pending:
                    self._open_admission()
                    self.changed()
            raise
        finally:
            if self._restore_job is job:
                self._restore_job = None

    def _check_restore_alive(self, job: _RestoreJob, step: str) -> None:
        if job.checkpoint_id in self._resumed:
            raise _stale(job.checkpoint_id)
        if self.clock.now() > job.deadline:
            raise deadline_exceeded(f"the restore's {step} outlived its deadline", job.deadline)

    async def _undo_install(self, job: _RestoreJob, records: Sequence[RestoredRecord]) -> None:
        episodes = [r.restored_as for r in records]
        try:
            await self.participant.discard_installed(episodes)
        except Exception as exc:
            # Nothing else can free it now; the process reports itself as having served, so
            # it refuses further restores rather than installing over leftovers.
            log.error(
                "restore %s failed and its installed state could not be freed (%s)",
                job.checkpoint_id,
                type(exc).__name__,
                exc_info=exc,
                extra={"checkpoint_id": job.checkpoint_id},
            )

    def _read_selected(self, job: _RestoreJob) -> tuple[StoredManifest, list[dict[str, Any]]]:
        wanted = {e.capture_key for e in job.scope}
        part = layout.part_path(
            job.checkpoint_dir, self.participant.kind.value, self.participant.instance
        )

        seen: set[object] = set()

        def select(record: dict[str, Any]) -> bool:
            try:
                episode = EpisodeId.from_json(record.get("episode_id"))
            except ValueError as exc:
                raise corrupt_checkpoint(
                    f"a record has an invalid episode_id: {exc}", part
                ) from exc
            # A writer stores each record identity once; two records of one identity would
            # install one state and silently drop the other (or install it twice). The kind
            # says what the identity is: the episode, or (resources) the episode's session.
            key = episode.capture_key
            identity = self.participant.record_identity(episode, record)
            if identity in seen:
                raise corrupt_checkpoint(f"two records of episode {key}", part, capture_key=key)
            seen.add(identity)
            if key in wanted and episode.attempt >= MAX_ATTEMPT:
                raise rejected_checkpoint(
                    f"episode {key} is at the highest attempt: it has no next attempt to restore as",
                    path=part,
                    capture_key=key,
                )
            return key in wanted

        return self.storage.read_part(
            job.checkpoint_dir, self.participant.kind.value, self.participant.instance, select
        )

    # -- Resume -------------------------------------------------------------------------

    async def resume(self, checkpoint_id: str, deadline: float) -> bool:
        """Reopen admission; returns whether the call was idempotent (nothing to end)."""
        self._check_id(checkpoint_id)
        self._check_deadline(deadline, allow_past=True)
        return await self._resume(checkpoint_id, deadline)

    async def _resume(
        self, checkpoint_id: str, deadline: float, *, lease_expiry: float | None = None
    ) -> bool:
        """Resume, waiting outside the lock for whatever must end first.

        No lock is held while waiting on storage or hooks: a write stuck in a frozen
        filesystem must not keep every other RPC (and the lease watcher) from answering.
        A write that has not begun publishing is fenced off at once and never waited for;
        one whose manifest link is under way (it cannot be withdrawn) and a cancelled export
        are waited for until the deadline, and admission reopens then regardless. A restore
        still reading is abandoned; one installing, and a commit's cleanup, are waited for
        (past the deadline the Resume is refused and nothing changed: retry it).
        With `lease_expiry`, nothing happens unless that lease is still the current one.
        """
        try:
            while True:
                async with self._lock:
                    if lease_expiry is not None and (
                        self._active_id != checkpoint_id or self._lease_expires_at != lease_expiry
                    ):
                        return True
                    step = self._resume_step(checkpoint_id)
                if isinstance(step, bool):
                    return step
                awaited, required = step
                try:
                    await self._await_until(deadline, awaited, required or "", swallow=True)
                except CheckpointError:
                    if required is not None:
                        raise
                if required is None:
                    break
            async with self._lock:
                return self._finish_resume(checkpoint_id)
        finally:
            self._resuming.discard(checkpoint_id)

    def _resume_step(self, checkpoint_id: str) -> bool | tuple[asyncio.Future[Any], str | None]:
        """One look at what a Resume of this id must do, under the lock.

        Returns the answer, or what to wait for and, if the wait is required, the refusal to
        give when it does not end in time (None: reopen once waited, in time or not)."""
        if checkpoint_id in self._resumed:
            return True
        restore = self._restore_job
        if restore is not None and restore.running:
            assert restore.task is not None
            if restore.checkpoint_id != checkpoint_id:
                raise _conflict(checkpoint_id, restore.checkpoint_id, "a restore is under way")
            if restore.phase != "read":
                return restore.task, "a restore's install is still running; retry the resume"
            # Nothing is installed yet: the read's result will be dropped (the id is stale).
            return self._finish_unstarted(checkpoint_id, idempotent=False)
        if self._state is State.IDLE and self._active_id is None:
            # The Prepare never reached us (an earlier stage failed): fence its late arrival.
            return self._finish_unstarted(checkpoint_id, idempotent=True)
        if self._active_id != checkpoint_id:
            raise _conflict(checkpoint_id, self._active_id, "another checkpoint is active")
        job = self._commit_job
        if job is None or job.checkpoint_id != checkpoint_id or not job.running:
            return self._finish_resume(checkpoint_id)
        assert job.task is not None
        if job.phase == "cleanup":
            # Cleanup frees restored state through the server's hooks; reopening while it
            # runs would let a request claim state that is being freed.
            return job.task, "a commit's cleanup is still running; retry the resume"
        publishing = job.fence.stop()
        if job.phase == "export":
            job.task.cancel()
        elif not publishing:
            return self._finish_resume(checkpoint_id)
        self._resuming.add(checkpoint_id)
        return job.task, None

    def _finish_unstarted(self, checkpoint_id: str, *, idempotent: bool) -> bool:
        self._remember_resumed(checkpoint_id)
        if self._start_closed_pending:
            self._start_closed_pending = False
            self._open_admission()
        self.changed()
        return idempotent

    def _finish_resume(self, checkpoint_id: str) -> bool:
        if checkpoint_id in self._resumed or self._active_id != checkpoint_id:
            return True
        job = self._commit_job
        if job is not None and job.checkpoint_id == checkpoint_id:
            if job.running:
                log.warning(
                    "checkpoint %s: reopening while its stopped commit job has not ended",
                    checkpoint_id,
                    extra={"checkpoint_id": checkpoint_id},
                )
            self._commit_job = None
        self._start_closed_pending = False
        self._open_admission()
        self._remember_resumed(checkpoint_id)
        self._state = State.IDLE
        self._active_id = None
        self._lease_expires_at = None
        self._stop_lease_watcher()
        self.changed()
        return False

    # -- Retire and Forget --------------------------------------------------------------

    async def retire(
        self, checkpoint_id: str, deadline: float, episodes: Sequence[EpisodeId]
    ) -> tuple[str, ...]:
        self._check_id(checkpoint_id)
        self._check_deadline(deadline)
        if not episodes:
            raise invalid_request("episodes", "must name at least one episode")
        rollouts = {e.rollout_id for e in episodes}
        async with self._lock:
            self._check_not_shutting_down()
            self._check_retire_phase(checkpoint_id, deadline, "Retire")
            # Mark first: from here on late requests of these attempts are refused, whether or
            # not this retire finishes.
            for episode in episodes:
                self.retired_attempts.mark(episode)
            for rollout in rollouts:
                self._retires_running[rollout] = self._retires_running.get(rollout, 0) + 1
            self.changed()
        finished = False
        try:
            restore = self._restore_job
            if restore is not None and restore.task is not None:
                await self._await_until(
                    deadline, restore.task, "an install is still running", swallow=True
                )
            hooks = asyncio.gather(
                *(_call_hook("retire", self.participant.retire(e)) for e in episodes)
            )
            await self._await_until(
                deadline, hooks, "the retire did not finish before its deadline"
            )
            finished = True
        finally:
            for rollout in rollouts:
                self._retires_running[rollout] -= 1
                if not self._retires_running[rollout]:
                    del self._retires_running[rollout]
                if finished:
                    self._retires_cut_short.discard(rollout)
                else:
                    self._retires_cut_short.add(rollout)
            self.changed()
        return tuple(e.capture_key for e in episodes)

    async def forget(
        self, checkpoint_id: str, deadline: float, rollout_ids: Sequence[str]
    ) -> tuple[str, ...]:
        self._check_id(checkpoint_id)
        self._check_deadline(deadline)
        if not rollout_ids:
            raise invalid_request("rollout_ids", "must name at least one rollout")
        for rollout_id in rollout_ids:
            problem = rollout_id_problem(rollout_id)
            if problem is not None:
                raise invalid_request("rollout_ids", problem)
        async with self._lock:
            self._check_not_shutting_down()
            self._check_retire_phase(checkpoint_id, deadline, "Forget")
            blocked = sorted(
                r
                for r in set(rollout_ids)
                if r in self._retires_cut_short or r in self._retires_running
            )
            if blocked:
                raise CheckpointError(
                    Reason.RETIRE_INCOMPLETE,
                    "a retire of these rollouts has not freed everything yet; retire them again",
                    metadata={"rolloutIds": ",".join(blocked)},
                )
            self.retired_attempts.forget(rollout_ids)
            self.participant.forget(rollout_ids)
            self.changed()
            return tuple(sorted(set(rollout_ids)))

    def retire_cut_short(self, rollout_id: str) -> bool:
        """Whether a retire of this rollout ended before it freed everything."""
        return rollout_id in self._retires_cut_short

    def _check_retire_phase(self, checkpoint_id: str, deadline: float, operation: str) -> None:
        if self._state in OPEN_CHECKPOINT:
            raise invalid_phase(
                self._state,
                operation,
                f"{operation} is refused while a checkpoint is open: resume first",
            )
        if self._state is State.RESTORED:
            if checkpoint_id != self._active_id:
                raise _conflict(checkpoint_id, self._active_id, "RESTORED: use the restore's id")
            self._renew(deadline)

    # -- internals ----------------------------------------------------------------------

    def _check_id(self, checkpoint_id: str) -> None:
        if not is_valid_id(checkpoint_id):
            raise invalid_request(
                "checkpoint_id", "must be 1-128 characters matching ^[A-Za-z0-9][A-Za-z0-9._-]*$"
            )

    def _check_deadline(self, deadline: float, *, allow_past: bool = False) -> None:
        now = self.clock.now()
        if deadline - now > self.settings.max_deadline_seconds:
            raise invalid_request(
                "deadline", f"lies more than {self.settings.max_deadline_seconds:g} s ahead"
            )
        if not allow_past and deadline <= now:
            raise deadline_exceeded("the deadline has already passed", deadline)

    def _check_not_shutting_down(self) -> None:
        if self._shutting_down:
            raise CheckpointError(
                Reason.SHUTTING_DOWN, "the participant is shutting down", retry_after=1.0
            )

    def _fence(self, checkpoint_id: str, operation: str, allowed: set[State]) -> None:
        if checkpoint_id in self._resumed or checkpoint_id in self._resuming:
            raise _stale(checkpoint_id)
        if self._active_id is not None and self._active_id != checkpoint_id:
            raise _conflict(checkpoint_id, self._active_id, "another checkpoint is active")
        if self._state not in allowed:
            raise invalid_phase(
                self._state, operation, f"{operation} is not allowed in state {self._state}"
            )

    def _replay(self, checkpoint_id: str, operation: str, args: object) -> object | None:
        recorded = self._results.get((checkpoint_id, operation))
        if recorded is None:
            return None
        if recorded.args != args:
            raise _conflict(
                checkpoint_id,
                None,
                f"this id completed {operation} with another directory or scope",
            )
        return recorded.result

    def _renew(self, deadline: float) -> float:
        lease = deadline + self.settings.lease_grace_seconds
        self._lease_expires_at = max(self._lease_expires_at or lease, lease)
        if self._lease_task is None or self._lease_task.done():
            self._lease_task = self._spawn(self._watch_lease())
        return self._lease_expires_at

    def _stop_lease_watcher(self) -> None:
        """The lease is gone. A watcher left asleep until the old expiry would notice the
        next checkpoint's lease only then, however much earlier that one ends."""
        task, self._lease_task = self._lease_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _watch_lease(self) -> None:
        while (lease := self._lease_expires_at) is not None:
            await self.clock.sleep_until(lease)
            expires = self._lease_expires_at
            if expires is None or self.clock.now() < expires:
                continue
            checkpoint_id = self._active_id
            if checkpoint_id is None:
                return
            tagged = {"checkpoint_id": checkpoint_id}
            log.warning(
                "lease of checkpoint %s expired: resuming on our own", checkpoint_id, extra=tagged
            )
            self.observer.lease_expired(checkpoint_id)
            try:
                await self._resume(
                    checkpoint_id,
                    self.clock.now() + LEASE_RETRY_SECONDS,
                    lease_expiry=expires,
                )
            except CheckpointError as exc:
                log.warning(
                    "lease expiry could not reopen yet (%s); retrying", exc.message, extra=tagged
                )
                await self.clock.sleep_until(self.clock.now() + LEASE_RETRY_SECONDS)

    async def _open_after_start_closed(self, when: float) -> None:
        """Open a `start_closed` process nobody restored or resumed in time.

        A restore running at the timeout is waited for, not skipped: if it then fails, the
        process must still open on its own rather than stay closed forever."""
        await self.clock.sleep_until(when)
        while True:
            async with self._lock:
                restore = self._restore_job
                if restore is None or not restore.running:
                    if self._start_closed_pending and self._state is State.IDLE:
                        log.warning("start_closed: no restore or resume arrived; opening")
                        self._start_closed_pending = False
                        self._open_admission()
                        self.changed()
                    return
                assert restore.task is not None
                task = restore.task
            await asyncio.wait({task})

    def _close_admission(self) -> None:
        if self._admission_open:
            self.participant.close_admission()
            self._admission_open = False
            self._closed_since = self.clock.now()

    def _open_admission(self) -> None:
        if not self._admission_open:
            self.participant.open_admission()
            self._admission_open = True
            self._closed_since = None

    def _remember_resumed(self, checkpoint_id: str) -> None:
        self._resumed[checkpoint_id] = None
        self._resumed.move_to_end(checkpoint_id)
        while len(self._resumed) > RESUMED_IDS_KEPT:
            self._resumed.popitem(last=False)
        for key in [k for k in self._results if k[0] == checkpoint_id]:
            del self._results[key]

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        # A fresh context: a duty outlives the RPC that started it and must not log under
        # (or parent spans to) that RPC's checkpoint id.
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        assert error is not None
        log.critical("a background duty of the control plane failed", exc_info=error)
        for listener in list(self._fatal_listeners):
            listener(error)

    async def _await_until(
        self, deadline: float, awaitable: Awaitable[T], message: str, *, swallow: bool = False
    ) -> T:
        """Await `awaitable` until the (injected-clock) deadline without cancelling it.

        The work goes on after the deadline: a retry awaits the same work instead of starting
        it twice. With `swallow`, the work's own failure is ignored (only its end matters).
        """
        future = asyncio.ensure_future(awaitable)
        if not future.done():
            sleeper = asyncio.ensure_future(self.clock.sleep_until(deadline))
            try:
                await asyncio.wait({future, sleeper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
        if not future.done():
            raise deadline_exceeded(message, deadline)
        if swallow:
            return None  # type: ignore[return-value]
        return future.result()


# -- helpers --------------------------------------------------------------------------------


def _retrieve_exception(task: asyncio.Task[Any]) -> None:
    """A job may fail after every caller gave up on it; its error is then reported to the
    next caller (a retry), not logged as "never retrieved"."""
    if not task.cancelled():
        task.exception()


def _stale(checkpoint_id: str) -> CheckpointError:
    return CheckpointError(
        Reason.STALE_CHECKPOINT,
        f"checkpoint {checkpoint_id} was already resumed",
        metadata={"checkpointId": checkpoint_id},
    )


def _conflict(checkpoint_id: str, active: str | None, message: str) -> CheckpointError:
    metadata = {"checkpointId": checkpoint_id}
    if active is not None:
        metadata["activeCheckpointId"] = active
    return CheckpointError(Reason.CHECKPOINT_CONFLICT, message, metadata=metadata)


def _hook_failed(hook: str, exc: BaseException) -> CheckpointError:
    log.error("participant hook %s failed: %s", hook, type(exc).__name__, exc_info=exc)
    return CheckpointError(
        Reason.HOOK_FAILED,
        f"the server's {hook} hook raised {type(exc).__name__}",
        metadata={"hook": hook},
    )


async def _call_hook(hook: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except (CheckpointError, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise _hook_failed(hook, exc) from exc


def _serialize_records(records: Sequence[ExportRecord]) -> Iterator[bytes]:
    """JSON lines, key order kept, big integers kept; NaN, Infinity and objects refused.

    A generator, so the work happens in the writer's thread, not on the event loop.
    """
    for record in records:
        if "episode_id" in record.fields:
            raise CheckpointError(
                Reason.UNSERIALIZABLE_STATE,
                f"the record of {record.episode_id.capture_key} uses the reserved field episode_id",
                metadata={"captureKey": record.episode_id.capture_key},
            )
        line = {"episode_id": record.episode_id.to_json(), **record.fields}
        try:
            encoded = json.dumps(
                line, allow_nan=False, ensure_ascii=False, separators=(",", ":")
            ).encode()
        except (ValueError, TypeError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
            raise CheckpointError(
                Reason.UNSERIALIZABLE_STATE,
                f"the state of episode {record.episode_id.capture_key} cannot be stored as JSON: {exc}",
                metadata={"captureKey": record.episode_id.capture_key},
            ) from None
        yield encoded


def _restored_record(raw: dict[str, Any]) -> RestoredRecord:
    episode = EpisodeId.from_json(raw["episode_id"])
    fields = {k: v for k, v in raw.items() if k != "episode_id"}
    return RestoredRecord(checkpointed=episode, fields=fields)


def _report_differs(a: ReadinessReport, b: ReadinessReport) -> bool:
    return (a.ready, a.blocker_count, a.blockers, dict(a.counts)) != (
        b.ready,
        b.blocker_count,
        b.blockers,
        dict(b.counts),
    )


async def _first_of(awaitables: Sequence[Awaitable[Any]]) -> int:
    """Wait for the first of several awaitables; cancel the rest; return its index."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return min(i for i, t in enumerate(tasks) if t in done)
    finally:
        for task in tasks:
            task.cancel()


def _encode_page_token(capture_key: str) -> str:
    return base64.urlsafe_b64encode(capture_key.encode()).decode()


def _decode_page_token(token: str) -> str:
    try:
        key = base64.urlsafe_b64decode(token.encode()).decode()
        EpisodeId.from_capture_key(key)
    except (ValueError, binascii.Error, UnicodeError) as exc:
        raise invalid_request("page_token", "not a token this participant issued") from exc
    return key
