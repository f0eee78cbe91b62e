"""The participant control plane: one `ControlPlane` wraps one Participant.

It knows nothing of gRPC, HTTP, Starlette or Prometheus: the sidecar turns RPCs into calls
here and `CheckpointError`s into statuses, and the runtime wiring passes the observer that
exports metrics (`observe.ControlObserver` does nothing).

The rules below each prevent a specific loss; each lives with the concept it belongs to:

* One lock serializes transitions (`state_machine`), but Prepare's wait for readiness
  (`prepare_stream`), the export and write of a Commit (`commit_job`) and the install of a
  Restore (`restore_job`) run outside it, so a Resume can always interrupt them.
* A completed Prepare, Commit or Restore is recorded with its arguments and consulted before
  the state check: a controller that lost a reply and retries gets the same answer instead of
  INVALID_PHASE, and a retry with other arguments is a conflict rather than a silent redo.
* A Commit exports once per checkpoint id. A retry after a failed or slow write stores the
  same records again; re-exporting would store state from after the cut.
* The write cannot be cancelled (a thread), but a Resume sets its stop flag so a checkpoint
  the controller abandoned never publishes a manifest afterwards; what must end before the
  reopen is waited for outside the lock (`resumption`).
* The lease turns a dead controller into a Resume: the fleet never stays closed forever
  (`lease`).
* A deadline ends a call's wait, never the work (`waiting`): a retry awaits the same work.
* A rejoining Restore makes a survivor of a crashed fleet fresh again by retiring all it
  holds through the same steps as Retire (`retirement`), so a fleet one of whose members
  was replaced can be restored whole (`restore_job`, `restore_steps`).
* Arguments are checked before the lock is taken (`call_checks`); reads never take it
  (`control_views`); a data-plane change wakes fewer listeners than a state change
  (`changes`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from rollout_checkpoint.server.core.checkpoint_storage import (
    PartStorage,
    allowed_root_locations,
    validate_checkpoint_location,
)
from rollout_checkpoint.server.core.clock import Clock, SystemClock
from rollout_checkpoint.server.core.daemon_threads import run_in_daemon_thread
from rollout_checkpoint.server.core.episodes import EpisodeId, is_valid_id
from rollout_checkpoint.server.core.errors import invalid_request
from rollout_checkpoint.server.core.part_storage import CheckpointStorage, PublishedPart
from rollout_checkpoint.server.core.receipts import Receipt
from rollout_checkpoint.server.runtime import resumption
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.call_checks import check_checkpoint_id, check_deadline
from rollout_checkpoint.server.runtime.changes import ChangeSignals
from rollout_checkpoint.server.runtime.commit_job import CommitResult
from rollout_checkpoint.server.runtime.control_views import (
    ControlViews,
    LastPart,
    StatusSnapshot,
)
from rollout_checkpoint.server.runtime.duties import Duties
from rollout_checkpoint.server.runtime.lease import Lease, open_after_start_closed
from rollout_checkpoint.server.runtime.observe import ControlObserver
from rollout_checkpoint.server.runtime.part_chain import ChainSettings, PartChains
from rollout_checkpoint.server.runtime.part_writes import PartWrite, PartWrites
from rollout_checkpoint.server.runtime.participant import MAX_WEIGHT_VERSION, Participant
from rollout_checkpoint.server.runtime.prepare_stream import (
    PrepareUpdate,
    UpdateKind,
    prepare_updates,
)
from rollout_checkpoint.server.runtime.restore_job import RestoreResult
from rollout_checkpoint.server.runtime.restore_steps import RestoreSteps
from rollout_checkpoint.server.runtime.result_outbox import Acknowledgement
from rollout_checkpoint.server.runtime.retirement import Retirement
from rollout_checkpoint.server.runtime.state_machine import (
    ControlSettings,
    State,
    StateMachine,
)
from rollout_checkpoint.server.runtime.waiting import await_until, retrieve_exception

__all__ = [
    "CommitResult",
    "ControlPlane",
    "ControlSettings",
    "LastPart",
    "PrepareUpdate",
    "RestoreResult",
    "State",
    "StatusSnapshot",
    "UpdateKind",
]


MAX_ACKNOWLEDGED = 10_000
"""Receipts one AcknowledgeResults may name (a bounded request)."""


class ControlPlane(ControlViews, ChangeSignals):
    """The checkpoint control of one participant process: the calls the sidecar makes.

    Every call checks its arguments, makes its transition under the state machine's lock and
    waits for its job outside it, until its own deadline. Each raises `CheckpointError` (its
    reason says what the controller may do: retry, resume, restore elsewhere) and never
    anything else on a refusal; the job a call started goes on after the call's deadline.
    The read-only views come from `control_views.ControlViews`, the change event and the
    listeners from `changes.ChangeSignals`.
    """

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
        super().__init__()
        self.participant = participant
        self.settings = settings or ControlSettings()
        self.storage: CheckpointStorage = storage or PartStorage(
            allowed_roots=self.settings.allowed_checkpoint_roots
        )
        self.clock: Clock = clock or SystemClock()
        self.observer = observer or ControlObserver()
        self.retired_attempts = RetiredAttempts()
        self._last_part: LastPart | None = None
        self.part_writes = PartWrites(self.storage, self.changed, self._part_durable)
        self.part_chains = PartChains(
            ChainSettings(
                full_every=self.settings.incremental_full_every,
                max_stale_share=self.settings.incremental_max_stale_share,
            ),
            allowed_root_locations(self.settings.allowed_checkpoint_roots),
        )
        self._duties = Duties()
        lease = Lease(
            self,
            clock=self.clock,
            grace_seconds=self.settings.lease_grace_seconds,
            observer=self.observer,
            spawn=self._duties.spawn,
        )
        self._machine = StateMachine(
            participant,
            self.settings,
            clock=self.clock,
            observer=self.observer,
            retired_attempts=self.retired_attempts,
            lease=lease,
            changed=self.state_changed,
        )
        self._retirement = Retirement(self._machine)
        self._restores = RestoreSteps(
            self._machine, self.storage, self._retirement, self.part_chains
        )
        participant.attach(self)
        self.observer.attach(self)

    # -- ParticipantContext -------------------------------------------------------------

    @property
    def retired(self) -> RetiredAttempts:
        return self.retired_attempts

    def prepare_seconds_left(self) -> float | None:
        """Seconds until the deadline of the Prepare that closed admission (None outside a
        Prepare: a close for a Restore or at a `start_closed` start). A hook that does work
        at the close (the policy model's generation cuts) bounds it by this, so the Prepare
        never misses its deadline for it. Not part of `ParticipantContext`: a context
        without it (a multi-worker server's bridge) simply offers no such time."""
        machine = self._machine
        if machine.state is not State.PREPARING or machine.prepare_deadline is None:
            return None
        return max(0.0, machine.prepare_deadline - self.clock.now())

    @property
    def outbox_cap(self) -> int:
        """The most results an episode owner holds under receipts (`result_outbox`)."""
        return self.settings.outbox_cap

    @property
    def lineage(self) -> tuple[str, ...]:
        """The checkpoints what this process produces now descends from: the one its last
        Restore read, or none. A receipt carries it (`result_outbox.Receipt.lineage`)."""
        restored = self._machine.restored_from
        return (restored,) if restored else ()

    # -- lifecycle ----------------------------------------------------------------------

    def add_fatal_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Called when a background duty (the lease watcher, a timer) dies unexpectedly.

        A participant whose lease can no longer expire could leave the fleet closed forever,
        so such a failure is what liveness reports: the pod gets restarted."""
        self._duties.add_fatal_listener(listener)

    async def start(self) -> None:
        """Called once on the server's loop before any traffic.

        With `start_closed`, admission starts closed so a replacement process serves nothing
        before the controller's Restore (which a process that served anything must refuse).
        """
        if self.settings.start_closed:
            self._machine.start_closed_pending = True
            self._machine.close_admission()
            timeout = self.settings.start_closed_timeout_seconds
            if timeout is None:
                timeout = self.settings.lease_grace_seconds
            when = self.clock.now() + timeout
            self._duties.spawn(
                open_after_start_closed(self.clock, when, self._open_unless_restoring)
            )

    async def _open_unless_restoring(self) -> asyncio.Future[Any] | None:
        async with self._machine.lock:
            return self._machine.open_unless_restoring()

    async def begin_shutdown(self) -> None:
        """Refuse changes from now on (SHUTTING_DOWN); reads keep working."""
        self._machine.shutting_down = True
        self.participant.shutting_down_now()
        self.state_changed()

    async def close(self) -> None:
        """Stop background duties (lease watcher, timers). Synchronous writes already running
        finish; a background write that has not begun publishing is abandoned (its part is
        never published, so no fleet manifest can name it)."""
        self.part_writes.stop()
        await self._duties.stop()

    # -- Prepare, Renew -----------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline: float) -> AsyncIterator[PrepareUpdate]:
        """Close admission and yield progress until ready, the deadline, or the end.

        Checks and the transition happen before the first message, so a refusal surfaces
        as an error of the call rather than mid-stream.
        """
        started = self.clock.now()
        self._check_call(checkpoint_id, deadline)
        machine = self._machine
        async with machine.lock:
            machine.check_not_shutting_down()
            replayed = (checkpoint_id, "prepare") in machine.results
            if not replayed:
                machine.fence(
                    checkpoint_id, "Prepare", {State.IDLE, State.PREPARING, State.PREPARED}
                )
                if machine.state is State.IDLE:
                    machine.begin_prepare(checkpoint_id, deadline)
                else:
                    machine.lease.renew(deadline)
        return prepare_updates(self, checkpoint_id, deadline, started, replayed)

    async def mark_prepared(self, checkpoint_id: str) -> None:
        async with self._machine.lock:
            self._machine.mark_prepared(checkpoint_id)

    async def renew(self, checkpoint_id: str, deadline: float) -> float:
        self._check_call(checkpoint_id, deadline)
        machine = self._machine
        async with machine.lock:
            machine.check_not_shutting_down()
            machine.fence(
                checkpoint_id,
                "Renew",
                {State.PREPARING, State.PREPARED, State.COMMITTED, State.RESTORED},
            )
            return machine.lease.renew(deadline)

    # -- Commit, Restore ----------------------------------------------------------------

    async def commit(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        scope: frozenset[EpisodeId] | None,
        *,
        asynchronous: bool = False,
    ) -> CommitResult:
        """Export (once per id), write and publish this participant's part; PREPARED ->
        COMMITTED. A retry of the same arguments joins the running job or replays its result.

        `asynchronous`: answer at the snapshot and write in the background (`part_writes`;
        `await_part` reports the outcome)."""
        self._check_call(checkpoint_id, deadline)
        real_dir = await self._validated_dir(checkpoint_dir, deadline)
        args = (real_dir, scope, asynchronous)
        machine = self._machine
        async with machine.lock:
            joined = machine.join_commit(checkpoint_id, deadline, args, self)
        if isinstance(joined, CommitResult):
            return joined
        result = await await_until(
            self.clock, deadline, joined, "the commit did not finish before its deadline"
        )
        async with machine.lock:
            return machine.finish_commit(checkpoint_id, args, result)

    async def await_part(self, checkpoint_id: str, deadline: float | None) -> PartWrite | None:
        """The background write of an asynchronous commit, once it ended or `deadline`
        passed (None: at once); None when this process holds no such write.

        Read-only and not fenced: the id is normally resumed by then (the fleet runs on while
        the part is written)."""
        check_checkpoint_id(checkpoint_id)
        if deadline is not None:
            self._check_deadline(deadline, allow_past=True)
        write = self.part_writes.get(checkpoint_id)
        if write is None or write.task is None or deadline is None:
            return write
        remaining = deadline - self.clock.now()
        if remaining > 0 and not write.task.done():
            await asyncio.wait([write.task], timeout=remaining)
        return write

    def part_published(
        self, checkpoint_dir: str, part: PublishedPart, asynchronous: bool, generation: int
    ) -> None:
        """Note the last part this process published (GetStatus's `last_part`), cut in
        restore `generation`: once durable and its commit done, whatever the controller does
        with its checkpoint afterwards."""
        self._last_part = LastPart(checkpoint_dir, asynchronous, part.manifest, generation)

    def _part_durable(self, write: PartWrite, part: PublishedPart) -> None:
        """An asynchronous commit counts (records, bytes), and is the last part published,
        only once its part is durable: a snapshot whose write fails published nothing."""
        self.observer.committed(part.manifest.record_count, part.manifest.bytes)
        self.part_published(
            write.checkpoint_dir, part, asynchronous=True, generation=write.generation
        )

    async def restore(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        scope: frozenset[EpisodeId],
        *,
        rejoin: bool = False,
    ) -> RestoreResult:
        """Install the scoped episodes of a part as their next attempts; IDLE -> RESTORED
        (still closed until Resume). Only a process that has served nothing may restore,
        unless it `rejoin`s: then it first retires every episode it holds and forgets having
        served (`restore_job`). A retry must repeat `rejoin` (it is one of the arguments)."""
        self._check_call(checkpoint_id, deadline)
        real_dir = await self._validated_dir(checkpoint_dir, deadline)
        machine = self._machine
        async with machine.lock:
            joined = self._restores.join(checkpoint_id, deadline, (real_dir, scope, rejoin))
        if isinstance(joined, RestoreResult):
            return joined
        return await await_until(
            self.clock, deadline, joined, "the restore did not finish before its deadline"
        )

    async def _validated_dir(self, checkpoint_dir: str, deadline: float) -> str:
        """The checkpoint directory's real path (or its object-store URL), checked off the
        loop within the deadline (a hung filesystem must cost the call its deadline, not the
        participant its loop)."""
        check = asyncio.ensure_future(
            run_in_daemon_thread(
                functools.partial(
                    validate_checkpoint_location,
                    checkpoint_dir,
                    self.settings.allowed_checkpoint_roots,
                ),
                "checkpoint location check",
            )
        )
        check.add_done_callback(retrieve_exception)
        return await await_until(
            self.clock,
            deadline,
            check,
            "the checkpoint directory could not be checked before the deadline",
        )

    # -- Resume -------------------------------------------------------------------------

    async def resume(self, checkpoint_id: str, deadline: float) -> bool:
        """Reopen admission; returns whether the call was idempotent (nothing to end). It
        waits outside the lock for what must end first (`resumption`)."""
        check_checkpoint_id(checkpoint_id)
        self._check_deadline(deadline, allow_past=True)
        return await resumption.resume(self._machine, checkpoint_id, deadline)

    async def resume_on_expiry(
        self, checkpoint_id: str, deadline: float, lease_expiry: float
    ) -> bool:
        """The lease watcher's Resume: nothing happens unless `lease_expiry` is still the
        current lease of `checkpoint_id`."""
        return await resumption.resume(
            self._machine, checkpoint_id, deadline, lease_expiry=lease_expiry
        )

    # -- Retire and Forget (`retirement`) -------------------------------------------------

    async def retire(
        self, checkpoint_id: str, deadline: float, episodes: Sequence[EpisodeId]
    ) -> tuple[str, ...]:
        self._check_call(checkpoint_id, deadline)
        return await self._retirement.retire(checkpoint_id, deadline, episodes)

    async def forget(
        self, checkpoint_id: str, deadline: float, rollout_ids: Sequence[str]
    ) -> tuple[str, ...]:
        self._check_call(checkpoint_id, deadline)
        return await self._retirement.forget(checkpoint_id, deadline, rollout_ids)

    # -- AcknowledgeResults (`result_outbox`) --------------------------------------------

    async def acknowledge_results(
        self, deadline: float, receipts: Sequence[Receipt]
    ) -> Acknowledgement:
        """Release the results these receipts name. Allowed in every state (it only frees
        memory; a result it releases between a Prepare and its Commit is one the trainer
        holds); RECEIPT_MISMATCH releases nothing."""
        self._check_deadline(deadline)
        if not receipts:
            raise invalid_request("receipts", "name at least one receipt")
        if len(receipts) > MAX_ACKNOWLEDGED:
            raise invalid_request("receipts", f"at most {MAX_ACKNOWLEDGED} per call")
        outbox = self.participant.result_outbox()
        if outbox is None:
            return Acknowledgement(not_held=len(receipts))
        acknowledged = outbox.acknowledge(receipts)
        self.changed()
        return acknowledged

    # -- SetWeightVersion -----------------------------------------------------------------

    async def set_weight_version(self, deadline: float, version: int) -> int:
        """Stamp the calls admitted from now on with `version`; the version before. Allowed in
        every state and after SIGTERM (it changes no recorded call, only what later ones are
        stamped with); a kind without policy weights refuses INVALID_REQUEST."""
        self._check_deadline(deadline)
        if version > MAX_WEIGHT_VERSION:
            raise invalid_request(
                "weight_version", f"at most {MAX_WEIGHT_VERSION} (GetStatus counters are int64)"
            )
        previous = self.participant.set_weight_version(version)
        if previous is None:
            raise invalid_request(
                "weight_version",
                f"this {self.participant.kind.value} participant holds no policy weights: "
                "set the weight version on the policy model",
            )
        return previous

    # -- internals ----------------------------------------------------------------------

    def _check_call(self, checkpoint_id: str, deadline: float) -> None:
        check_checkpoint_id(checkpoint_id)
        self._check_deadline(deadline)

    def _check_deadline(self, deadline: float, *, allow_past: bool = False) -> None:
        check_deadline(
            self.clock, self.settings.max_deadline_seconds, deadline, allow_past=allow_past
        )
