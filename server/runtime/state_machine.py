"""The states of one participant and every transition between them, made under one lock.

`StateMachine` holds what a checkpoint's calls must agree on — the state, the active id, the
ids already resumed, the recorded results, the running commit and restore jobs, admission and
the lease — and changes it only in short synchronous steps taken with `lock` held. The control
plane (`control_plane.ControlPlane`) takes the lock, makes a step, and waits outside it: Prepare's
wait for readiness, the export and write of a Commit and the install of a Restore run outside
the lock, so a Resume can always interrupt them.

The rules each prevent a loss:

* Fencing: an id once resumed is STALE_CHECKPOINT for every later call (the last
  `RESUMED_IDS_KEPT` are remembered), and while a Resume waits for a stopped job to end its id
  is fenced already, so no call can start new work for a checkpoint being abandoned.
* Idempotent replay: a completed Prepare, Commit or Restore is recorded with its arguments and
  consulted before the state check, so a controller that lost a reply and retries gets the same
  answer instead of INVALID_PHASE, and a retry with other arguments is a conflict rather than a
  silent redo.
* State and admission never disagree: a Prepare whose close_admission hook fails is undone
  whole.
* Readiness (the `participant-readiness` health answer) drops for a `start_closed` process
  before its restore or resume, during a rejoining restore, while RESTORED, and for a pause
  longer than the threshold; a short checkpoint pause keeps the pod in its Service so
  clients see no churn.
* A rejoining restore seals the data plane from its join until it fails or is resumed
  (`rejoin_sealed`); the Restore's own transitions, and why each is ordered as it is, live
  in `restore_steps`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import (
    CheckpointError,
    Reason,
    invalid_phase,
)
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.commit_job import (
    CommitHost,
    CommitJob,
    CommitResult,
    commit_job_for,
)
from rollout_checkpoint.server.runtime.lease import Lease
from rollout_checkpoint.server.runtime.observe import ControlObserver
from rollout_checkpoint.server.runtime.part_chain import (
    DEFAULT_FULL_EVERY,
    DEFAULT_MAX_STALE_SHARE,
)
from rollout_checkpoint.server.runtime.participant import Participant
from rollout_checkpoint.server.runtime.refusals import conflict, hook_failed, stale
from rollout_checkpoint.server.runtime.restore_job import RestoreJob
from rollout_checkpoint.server.runtime.result_outbox import DEFAULT_OUTBOX_CAP

log = logging.getLogger(__name__)

RESUMED_IDS_KEPT = 64


class State(enum.StrEnum):
    IDLE = "IDLE"
    PREPARING = "PREPARING"
    PREPARED = "PREPARED"
    COMMITTED = "COMMITTED"
    RESTORED = "RESTORED"


OPEN_CHECKPOINT = frozenset({State.PREPARING, State.PREPARED, State.COMMITTED})


@dataclass(frozen=True, slots=True)
class ControlSettings:
    lease_grace_seconds: float = 600.0
    heartbeat_seconds: float = 1.0
    max_deadline_seconds: float = 86400.0
    allowed_checkpoint_roots: tuple[str, ...] = ()
    start_closed: bool = False
    start_closed_timeout_seconds: float | None = None
    readiness_pause_threshold_seconds: float = 30.0
    outbox_cap: int = DEFAULT_OUTBOX_CAP
    incremental_full_every: int = DEFAULT_FULL_EVERY
    incremental_max_stale_share: float = DEFAULT_MAX_STALE_SHARE


class Recorded(NamedTuple):
    """A completed call's arguments and result, replayed to a retry of the same call (a
    retry with other arguments is a conflict, not a replay)."""

    args: object
    result: object


ResumeStep = bool | tuple["asyncio.Future[Any]", str | None]
"""What a Resume must do next: its answer, or what to wait for (and the refusal if the wait
does not end in time, None: reopen once waited, in time or not)."""


class StateMachine:
    """The checkpoint state of one participant; every method but the views runs with `lock`
    held."""

    def __init__(
        self,
        participant: Participant,
        settings: ControlSettings,
        *,
        clock: Clock,
        observer: ControlObserver,
        retired_attempts: RetiredAttempts,
        lease: Lease,
        changed: Callable[[], None],
    ) -> None:
        self.participant = participant
        self.settings = settings
        self.clock = clock
        self.observer = observer
        self.retired_attempts = retired_attempts
        self.lease = lease
        self.changed = changed
        self.lock = asyncio.Lock()
        self.state = State.IDLE
        self.active_id: str | None = None
        self.resumed: OrderedDict[str, None] = OrderedDict()
        self.resuming: set[str] = set()
        """Ids whose Resume waits (outside the lock) for a stopped job to end: fenced like
        resumed ids, so no call can start new work for them in the meantime."""
        self.results: dict[tuple[str, str], Recorded] = {}
        self.commit_job: CommitJob | None = None
        self.restore_job: RestoreJob | None = None
        self.admission_open = True
        self.closed_since: float | None = None
        self.prepare_deadline: float | None = None
        """The deadline of the last Prepare that closed admission (`prepare_seconds_left`)."""
        self.start_closed_pending = False
        self.rejoin_sealed = False
        """A rejoining restore is under way (or RESTORED by one, until Resume): the data plane
        refuses everything new, as a `start_closed` process does before its restore (see
        `awaiting_restore`)."""
        self.shutting_down = False
        self.restored_from: str | None = None
        """The checkpoint the last successful Restore read: what this process's results
        descend from (a receipt's lineage)."""

    # -- readiness ------------------------------------------------------------------------

    def readiness_serving(self) -> bool:
        """Should new HTTP traffic come here? (See the module docstring for why.)"""
        if self.shutting_down or self.awaiting_restore or self.state is State.RESTORED:
            return False
        if self.admission_open or self.closed_since is None:
            return True
        paused = self.clock.now() - self.closed_since
        return paused < self.settings.readiness_pause_threshold_seconds

    def readiness_changes_at(self) -> float | None:
        """When `readiness_serving` flips without any event (a pause crossing the threshold)."""
        if self.admission_open or self.closed_since is None:
            return None
        return self.closed_since + self.settings.readiness_pause_threshold_seconds

    @property
    def awaiting_restore(self) -> bool:
        """The data plane is sealed (`ParticipantContext.start_closed_pending`): a
        `start_closed` process before its restore or resume, or a rejoining restore."""
        return self.start_closed_pending or self.rejoin_sealed

    # -- fencing and replay ---------------------------------------------------------------

    def check_not_shutting_down(self) -> None:
        if self.shutting_down:
            raise CheckpointError(
                Reason.SHUTTING_DOWN, "the participant is shutting down", retry_after=1.0
            )

    def fence(self, checkpoint_id: str, operation: str, allowed: set[State]) -> None:
        """Refuse a resumed id (STALE), another active id (CONFLICT) or a wrong state."""
        if checkpoint_id in self.resumed or checkpoint_id in self.resuming:
            raise stale(checkpoint_id)
        if self.active_id is not None and self.active_id != checkpoint_id:
            raise conflict(checkpoint_id, self.active_id, "another checkpoint is active")
        if self.state not in allowed:
            raise invalid_phase(
                self.state, operation, f"{operation} is not allowed in state {self.state}"
            )

    def replay(self, checkpoint_id: str, operation: str, args: object) -> object | None:
        """The recorded result of this call, None if it never completed; CONFLICT if it
        completed with other arguments."""
        recorded = self.results.get((checkpoint_id, operation))
        if recorded is None:
            return None
        if recorded.args != args:
            raise conflict(
                checkpoint_id,
                None,
                f"this id completed {operation} with other arguments (directory, scope or rejoin)",
            )
        return recorded.result

    def replay_or_fence(
        self, checkpoint_id: str, operation: str, args: object, allowed: set[State]
    ) -> object | None:
        """A job's start: refused while shutting down; then its recorded result, consulted
        before the state check (a retry gets its answer, not INVALID_PHASE); else fenced."""
        self.check_not_shutting_down()
        recorded = self.replay(checkpoint_id, operation.lower(), args)
        if recorded is None:
            self.fence(checkpoint_id, operation, allowed)
        return recorded

    def remember_resumed(self, checkpoint_id: str) -> None:
        self.resumed[checkpoint_id] = None
        self.resumed.move_to_end(checkpoint_id)
        while len(self.resumed) > RESUMED_IDS_KEPT:
            self.resumed.popitem(last=False)
        for key in [k for k in self.results if k[0] == checkpoint_id]:
            del self.results[key]

    # -- admission ------------------------------------------------------------------------

    def close_admission(self) -> None:
        if self.admission_open:
            self.participant.close_admission()
            self.admission_open = False
            self.closed_since = self.clock.now()

    def open_admission(self) -> None:
        if not self.admission_open:
            self.participant.open_admission()
            self.admission_open = True
            self.closed_since = None

    def open_unless_restoring(self) -> asyncio.Future[Any] | None:
        """The start-closed timeout: the running restore to wait for, or open (if still
        pending and nothing else took over) and None."""
        restore = self.restore_job
        if restore is not None and restore.running:
            assert restore.task is not None
            return restore.task
        if self.start_closed_pending and self.state is State.IDLE:
            log.warning("start_closed: no restore or resume arrived; opening")
            self.start_closed_pending = False
            self.open_admission()
            self.changed()
        return None

    # -- Prepare, Commit ------------------------------------------------------------------

    def begin_prepare(self, checkpoint_id: str, deadline: float) -> None:
        """IDLE -> PREPARING: close admission (all of it undone if the hook fails)."""
        if self.restore_job is not None:
            raise CheckpointError(
                Reason.CHECKPOINT_CONFLICT,
                "a restore is under way",
                metadata={
                    "checkpointId": checkpoint_id,
                    "activeCheckpointId": self.restore_job.checkpoint_id,
                },
            )
        self.active_id = checkpoint_id
        self.state = State.PREPARING
        self.prepare_deadline = deadline
        self.lease.renew(deadline)
        try:
            self.close_admission()
        except Exception as exc:
            # State and admission must never disagree: undo the whole transition. Admission
            # is still recorded open (the hook raised before it was marked closed), so there
            # is nothing to reopen: the next Prepare calls the hook again.
            self.state = State.IDLE
            self.active_id = None
            self.lease.end()
            self.changed()
            raise hook_failed("close_admission", exc) from exc
        self.changed()

    def mark_prepared(self, checkpoint_id: str) -> None:
        """PREPARING -> PREPARED if this id is still preparing and the participant is ready."""
        if (
            self.active_id == checkpoint_id
            and self.state is State.PREPARING
            and self.participant.ready()
        ):
            self.state = State.PREPARED
            self.results[(checkpoint_id, "prepare")] = Recorded((), None)
            if self.closed_since is not None:
                self.observer.drained(self.clock.now() - self.closed_since)
            self.changed()

    def join_commit(
        self,
        checkpoint_id: str,
        deadline: float,
        args: tuple[str, frozenset[EpisodeId] | None, bool],
        host: CommitHost,
    ) -> CommitResult | asyncio.Task[CommitResult]:
        """A Commit's start: its recorded result (a retry), or the task of the job it joins
        (started if need be; see `commit_job.commit_job_for`). Renews the lease."""
        recorded = self.replay_or_fence(checkpoint_id, "Commit", args, {State.PREPARED})
        if recorded is not None:
            assert isinstance(recorded, CommitResult)
            return recorded
        real_dir, scope, asynchronous = args
        job = commit_job_for(self.commit_job, checkpoint_id, real_dir, scope, asynchronous)
        self.lease.renew(deadline)
        if not self.participant.ready():
            raise invalid_phase(self.state, "Commit", "the participant is no longer ready")
        if scope is None and self.participant.requires_scope:
            raise CheckpointError(
                Reason.SCOPE_REQUIRED, "this participant needs an explicit commit scope"
            )
        self.commit_job = job
        return job.start(host)

    def finish_commit(self, checkpoint_id: str, args: object, result: CommitResult) -> CommitResult:
        """PREPARED -> COMMITTED, recorded for replay (unless a retry that awaited the same job
        recorded it first: then its answer)."""
        recorded = self.results.get((checkpoint_id, "commit"))
        if recorded is not None:
            assert isinstance(recorded.result, CommitResult)
            return recorded.result
        self.fence(checkpoint_id, "Commit", {State.PREPARED})
        self.state = State.COMMITTED
        self.results[(checkpoint_id, "commit")] = Recorded(args, result)
        if result.manifest is not None:
            self.observer.committed(result.manifest.record_count, result.manifest.bytes)
        self.changed()
        return result

    # -- Resume, Retire -------------------------------------------------------------------

    def resume_step(self, checkpoint_id: str) -> ResumeStep:
        """One look at what a Resume of this id must do (`resumption` says why each wait)."""
        if checkpoint_id in self.resumed:
            return True
        restore = self.restore_job
        if restore is not None and restore.running:
            assert restore.task is not None
            if restore.checkpoint_id != checkpoint_id:
                raise conflict(checkpoint_id, restore.checkpoint_id, "a restore is under way")
            if restore.phase not in ("discard", "read"):
                return restore.task, "a restore's install is still running; retry the resume"
            # Nothing is installed yet: the read's result will be dropped (the id is stale).
            # A rejoin's discard goes on to its end like a Retire's (its marks are set, so
            # reopening cannot let a discarded attempt back in); nothing is forgotten.
            return self._finish_unstarted(checkpoint_id, idempotent=False)
        if self.state is State.IDLE and self.active_id is None:
            # The Prepare never reached us (an earlier stage failed): fence its late arrival.
            return self._finish_unstarted(checkpoint_id, idempotent=True)
        if self.active_id != checkpoint_id:
            raise conflict(checkpoint_id, self.active_id, "another checkpoint is active")
        job = self.commit_job
        if job is None or job.checkpoint_id != checkpoint_id or not job.running:
            return self.finish_resume(checkpoint_id)
        assert job.task is not None
        if job.phase == "cleanup":
            # Cleanup frees restored state through the server's hooks; reopening while it
            # runs would let a request claim state that is being freed.
            return job.task, "a commit's cleanup is still running; retry the resume"
        publishing = job.stop()
        # A cancelled export (or a job that has not run a step: its phase is still "export")
        # ends promptly and typed; it is waited for so none of it runs after the reopen.
        if job.phase != "export" and not publishing:
            return self.finish_resume(checkpoint_id)
        self.resuming.add(checkpoint_id)
        return job.task, None

    def _finish_unstarted(self, checkpoint_id: str, *, idempotent: bool) -> bool:
        """Fence an id whose checkpoint never started here; returns the reply's `idempotent`.

        The Resume that opens a `start_closed` process changed something (admission opened,
        readiness rose), so it answers False even where fencing alone would be idempotent: a
        controller reading True would believe the process was already open."""
        self.remember_resumed(checkpoint_id)
        opened = self.awaiting_restore
        if opened:
            self.start_closed_pending = False
            self.rejoin_sealed = False
            self.open_admission()
        self.changed()
        return idempotent and not opened

    def finish_resume(self, checkpoint_id: str) -> bool:
        """Back to IDLE and open; returns whether there was nothing to end (idempotent)."""
        if checkpoint_id in self.resumed or self.active_id != checkpoint_id:
            return True
        job = self.commit_job
        if job is not None and job.checkpoint_id == checkpoint_id:
            if job.running:
                log.warning(
                    "checkpoint %s: reopening while its stopped commit job has not ended",
                    checkpoint_id,
                    extra={"checkpoint_id": checkpoint_id},
                )
            self.commit_job = None
        self.start_closed_pending = False
        self.rejoin_sealed = False
        self.open_admission()
        self.remember_resumed(checkpoint_id)
        self.state = State.IDLE
        self.active_id = None
        self.lease.end()
        self.changed()
        return False

    def check_retire_phase(self, checkpoint_id: str, deadline: float, operation: str) -> None:
        """Retire and Forget: refused while a checkpoint is open; RESTORED renews its lease."""
        if self.state in OPEN_CHECKPOINT:
            raise invalid_phase(
                self.state,
                operation,
                f"{operation} is refused while a checkpoint is open: resume first",
            )
        if self.state is State.RESTORED:
            if checkpoint_id != self.active_id:
                raise conflict(checkpoint_id, self.active_id, "RESTORED: use the restore's id")
            self.lease.renew(deadline)
