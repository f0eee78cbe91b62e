"""The transitions a Restore makes on the state machine, each taken with its lock held.

`restore_job.RestoreJob` reads and installs outside the lock; at each step it comes back here
(`restore_job.RestoreTransitions`). The rules each prevent a loss:

* Only a process that has served nothing may restore (FRESH_PROCESS_REQUIRED): installing
  beside state a request already changed would mix the two. A rejoining restore is the one
  exception, and it earns it: it discards everything first, and is refused again if the
  process still serves after the discard.
* A rejoining restore seals the data plane from its join until it fails or is resumed, as a
  `start_closed` process is sealed: closed admission still lets replay-safe work through
  (a seed), and what that tracked after the discard would be served state beside the
  restored one. The seal is set at the join, under the lock, so nothing new starts between
  the discard and the install.
* Every step first refuses a job whose id was resumed meanwhile (STALE) or that outlived its
  deadline: a Resume or a deadline abandons the restore, and the job must not go on to
  install (or report RESTORED) after it.
* The restored episodes' checkpointed attempts are marked retired before RESTORED is
  reported: a late request of the crashed attempt must never change the restored state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, deadline_exceeded
from rollout_checkpoint.server.core.layout import StoredManifest
from rollout_checkpoint.server.core.part_storage import CheckpointStorage
from rollout_checkpoint.server.runtime.part_chain import PartChains
from rollout_checkpoint.server.runtime.participant import RestoredRecord
from rollout_checkpoint.server.runtime.refusals import conflict, hook_failed, stale
from rollout_checkpoint.server.runtime.restore_job import Discard, RestoreJob, RestoreResult
from rollout_checkpoint.server.runtime.result_outbox import is_outbox_record
from rollout_checkpoint.server.runtime.state_machine import Recorded, State, StateMachine


class RestoreSteps:
    """The Restore transitions of one state machine (`restore_job.RestoreTransitions`): the
    join, the discard of a rejoin, the install and its undo. Every method runs with the
    machine's `lock` held."""

    def __init__(
        self,
        machine: StateMachine,
        storage: CheckpointStorage,
        discard: Discard,
        chains: PartChains,
    ) -> None:
        self._chains = chains
        self._machine = machine
        self._storage = storage
        self._discard = discard
        # What the job reaches through its `RestoreTransitions`: the machine's own.
        self.lock = machine.lock
        self.participant = machine.participant
        self.clock = machine.clock
        self.observer = machine.observer

    def join(
        self, checkpoint_id: str, deadline: float, args: tuple[str, frozenset[EpisodeId], bool]
    ) -> RestoreResult | asyncio.Task[RestoreResult]:
        """A Restore's start: its recorded result (a retry), or the task of the restore of
        the same arguments (its deadline extended), or a new one — only in a process that
        has served nothing, unless it rejoins (`args`' last item): then admission closes and
        the data plane is sealed here (see the module docstring)."""
        machine = self._machine
        recorded = machine.replay_or_fence(checkpoint_id, "Restore", args, {State.IDLE})
        if recorded is not None:
            assert isinstance(recorded, RestoreResult)
            return recorded
        job = machine.restore_job
        if job is not None:
            if job.checkpoint_id != checkpoint_id or job.args != args:
                raise conflict(checkpoint_id, job.checkpoint_id, "another restore is under way")
            job.deadline = max(job.deadline, deadline)
            assert job.task is not None
            return job.task
        real_dir, scope, rejoin = args
        if not rejoin and machine.participant.has_served():
            raise CheckpointError(
                Reason.FRESH_PROCESS_REQUIRED,
                "this process has already served sessions or episodes; restore into a fresh "
                "one, or restore this one with rejoin",
            )
        job = RestoreJob(checkpoint_id, real_dir, scope, deadline, rejoin=rejoin)
        if rejoin:
            try:
                machine.close_admission()
            except Exception as exc:
                # Nothing changed (admission is still recorded open): refuse the restore.
                raise hook_failed("close_admission", exc) from exc
            machine.rejoin_sealed = True
            machine.changed()
        machine.restore_job = job
        # A restore boundary: the parts published before it hold another history than the
        # state installed now, so the next part is full (part_chain.py).
        self._chains.reset()
        return job.start(self, self._storage, self._discard)

    def _check_alive(self, job: RestoreJob, step: str) -> None:
        if job.checkpoint_id in self._machine.resumed:
            raise stale(job.checkpoint_id)
        if self.clock.now() > job.deadline:
            raise deadline_exceeded(f"the restore's {step} outlived its deadline", job.deadline)

    def begin_discard(self, job: RestoreJob) -> tuple[list[EpisodeId], list[EpisodeId]]:
        self._check_alive(job, "discard")
        pending = set(self.participant.restored_pending())
        held = {info.episode_id for info in self.participant.episodes()} - pending
        return sorted(held), sorted(pending)

    def finish_discard(self, job: RestoreJob) -> None:
        self._check_alive(job, "discard")
        try:
            self.participant.forget_served()
        except Exception as exc:
            raise hook_failed("forget_served", exc) from exc
        if self.participant.has_served():
            # Installing beside what still runs here would mix its state with the
            # checkpoint's: exactly what FRESH_PROCESS_REQUIRED exists to prevent.
            raise CheckpointError(
                Reason.FRESH_PROCESS_REQUIRED,
                "this process still serves sessions or episodes after discarding every one "
                "it listed (its kind cannot forget having served, or something it did not "
                "list was running); retry the restore, or restore into a fresh process",
            )
        job.phase = "read"
        self._machine.changed()

    def begin_install(self, job: RestoreJob) -> None:
        self._check_alive(job, "read")
        job.phase = "install"
        self._machine.close_admission()
        self._machine.changed()

    def finish_restore(
        self, job: RestoreJob, manifest: StoredManifest, records: Sequence[RestoredRecord]
    ) -> RestoreResult:
        self._check_alive(job, "install")
        machine = self._machine
        # A late request of the crashed attempt must never change the restored state.
        for record in records:
            machine.retired_attempts.mark(record.checkpointed)
        result = RestoreResult(
            source_checkpoint_id=manifest.checkpoint_id,
            # Held results are no episodes to continue: ListResults offers them.
            restored=tuple(
                sorted(
                    {r.restored_as.capture_key for r in records if not is_outbox_record(r.fields)}
                )
            ),
        )
        machine.state = State.RESTORED
        machine.active_id = job.checkpoint_id
        machine.restored_from = manifest.checkpoint_id
        machine.lease.renew(job.deadline)
        machine.results[(job.checkpoint_id, "restore")] = Recorded(job.args, result)
        self.observer.restored(len(records), manifest.bytes)
        job.phase = "done"
        machine.changed()
        return result

    def reopen_after_failed_restore(self, job: RestoreJob) -> None:
        machine = self._machine
        if job.rejoin and machine.state is State.IDLE:
            machine.rejoin_sealed = False
            machine.changed()
        if machine.state is State.IDLE and not machine.awaiting_restore:
            machine.open_admission()
            machine.changed()

    def restore_ended(self, job: RestoreJob) -> None:
        if self._machine.restore_job is job:
            self._machine.restore_job = None
