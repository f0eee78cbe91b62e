"""The restore job: read a part, install it all or nothing, and undo it on any failure.

A Restore RPC starts the job (or joins the running one of the same arguments) and waits for it
until its own deadline. The rules each prevent a loss:

* Read and verify off the loop, bounded by the deadline: storage that hangs costs this
  restore, not every later one (and not the event loop).
* Nothing is installed until the whole selection is read and verified: a torn or corrupt part
  is refused before the participant holds any of it. Two records of one identity are
  CORRUPT_CHECKPOINT (one state would silently replace the other), and an episode at the
  highest attempt is refused: it has no next attempt to restore as.
* An install is never interrupted — a half-installed set is the one outcome that must not
  exist — but if it outlived the deadline, or its restore was resumed meanwhile, once it ends
  its attempt N+1 episodes are freed again through the participant (`discard_installed`)
  before admission reopens. The process stays fresh, so a retry of the same restore works.
* The restored episodes' checkpointed attempts are marked retired: a late request of the
  crashed attempt must never change the restored state.
* A rejoining restore (`rejoin`: a survivor of a fleet whose crashed member was replaced)
  first discards what the process holds: admission closed and the data plane sealed from
  the join on (a seed admitted between the discard and the install would be served state
  beside the restored one), then every held episode retired exactly as by Retire (marks
  under the lock before any hook runs; a late request of a discarded attempt must never
  reach the restored state) — except restored pending ones, which no request ever used:
  they are dropped without a mark (`discard_installed`), since a mark would refuse the
  very attempts N+1 that a second try of the same recovery installs again — then
  `Participant.forget_served`. Only then does it read and
  install like a restore into a fresh process; a process still served after the discard is
  refused FRESH_PROCESS_REQUIRED rather than installing beside what it serves. A Resume
  during the discard abandons it like one during the read: the retires go on to their end,
  nothing is forgotten or installed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.daemon_threads import run_in_daemon_thread
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId
from rollout_checkpoint.server.core.errors import corrupt_checkpoint, rejected_checkpoint
from rollout_checkpoint.server.core.layout import StoredManifest
from rollout_checkpoint.server.core.part_storage import CheckpointStorage
from rollout_checkpoint.server.runtime.collector import collection_paused, freeze_restored_heap
from rollout_checkpoint.server.runtime.participant import Participant, RestoredRecord
from rollout_checkpoint.server.runtime.parts import ControlParts
from rollout_checkpoint.server.runtime.records_codec import restored_record
from rollout_checkpoint.server.runtime.refusals import call_hook
from rollout_checkpoint.server.runtime.restored_memory import StringTable, release_free_heap
from rollout_checkpoint.server.runtime.result_outbox import is_outbox_record
from rollout_checkpoint.server.runtime.waiting import await_until, retrieve_exception

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What a Restore installed: from which checkpoint, and the capture keys restored."""

    source_checkpoint_id: str
    restored: tuple[str, ...]


class Discard(Protocol):
    """How a rejoining restore retires what the process holds: `retirement.Retirement`'s two
    steps, so the discarded episodes are retired exactly as by Retire."""

    def mark(self, episodes: Sequence[EpisodeId]) -> None:
        """With the lock held: mark the attempts retired before any hook runs."""
        ...

    async def free(
        self, episodes: Sequence[EpisodeId], deadline: float, *, wait_for_install: bool
    ) -> None:
        """Stop and free the marked episodes through the participant, until the deadline."""
        ...


class RestoreTransitions(ControlParts, Protocol):
    """The control plane's transitions a restore job makes, each with `lock` held."""

    @property
    def lock(self) -> asyncio.Lock: ...

    def begin_discard(self, job: RestoreJob) -> tuple[list[EpisodeId], list[EpisodeId]]:
        """Refuse a job resumed or past its deadline; else what the process holds: the
        episodes to retire (every one a request has used) and the restored pending ones to
        drop without a mark (no request ever used them)."""
        ...

    def finish_discard(self, job: RestoreJob) -> None:
        """Refuse a job resumed or past its deadline; else forget having served (refused
        FRESH_PROCESS_REQUIRED if the process still has) and go on to the read."""
        ...

    def begin_install(self, job: RestoreJob) -> None:
        """Refuse a job resumed or past its deadline; else close admission for the install."""
        ...

    def finish_restore(
        self, job: RestoreJob, manifest: StoredManifest, records: Sequence[RestoredRecord]
    ) -> RestoreResult:
        """Refuse a job resumed or past its deadline; else RESTORED (still closed)."""
        ...

    def reopen_after_failed_restore(self, job: RestoreJob) -> None:
        """Reopen admission that this restore closed (and unseal a rejoin's data plane),
        unless a later transition owns it."""
        ...

    def restore_ended(self, job: RestoreJob) -> None:
        """The job holds the restore slot no more (called without the lock)."""
        ...


@dataclass(eq=False)
class RestoreJob:
    checkpoint_id: str
    checkpoint_dir: str
    scope: frozenset[EpisodeId]
    deadline: float
    rejoin: bool = False
    """A rejoining restore: discard what the process holds first (the module docstring)."""
    phase: str = "read"
    """discard (a rejoin), read (nothing installed: a Resume may abandon either), install,
    undo, done."""
    task: asyncio.Task[RestoreResult] | None = None

    def __post_init__(self) -> None:
        if self.rejoin:
            self.phase = "discard"

    @property
    def args(self) -> tuple[str, frozenset[EpisodeId], bool]:
        """What a retry must repeat: the directory, the scope and `rejoin`."""
        return (self.checkpoint_dir, self.scope, self.rejoin)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(
        self, machine: RestoreTransitions, storage: CheckpointStorage, discard: Discard
    ) -> asyncio.Task[RestoreResult]:
        """Start the job's task on the running loop (once). A rejoin's join closed admission
        already; the job reopens it if it fails."""
        assert self.task is None
        self.task = asyncio.get_running_loop().create_task(self._run(machine, storage, discard))
        self.task.add_done_callback(retrieve_exception)
        return self.task

    async def _run(
        self, machine: RestoreTransitions, storage: CheckpointStorage, discard: Discard
    ) -> RestoreResult:
        """Discard (a rejoin), read and verify off the loop, install all or nothing, then
        RESTORED (closed).

        On any failure nothing stays installed (what the discard retired stays retired) and
        admission this job closed reopens; the failure is raised to whoever awaits the job."""
        closed_here = self.rejoin
        records: list[RestoredRecord] = []
        installed = False
        try:
            if self.rejoin:
                await self._discard(machine, discard)
            reading = asyncio.ensure_future(
                run_in_daemon_thread(
                    functools.partial(self._read_selected, machine.participant, storage),
                    f"part read {self.checkpoint_id}",
                )
            )
            reading.add_done_callback(retrieve_exception)
            with machine.observer.phase("read"):
                manifest, records = await await_until(
                    machine.clock,
                    self.deadline,
                    reading,
                    "the restore's read did not finish before its deadline",
                )
            freeze_restored_heap()  # before the install allocates: see collector.py
            async with machine.lock:
                machine.begin_install(self)
                closed_here = True
            with machine.observer.phase("install"):
                await call_hook("install", machine.participant.install(records))
            installed = True
            freeze_restored_heap()
            async with machine.lock:
                return machine.finish_restore(self, manifest, records)
        except BaseException:
            if installed:
                self.phase = "undo"
                await self._undo_install(machine.participant, records)
            if closed_here:
                async with machine.lock:
                    machine.reopen_after_failed_restore(self)
            raise
        finally:
            machine.restore_ended(self)

    async def _discard(self, machine: RestoreTransitions, discard: Discard) -> None:
        """Retire every episode the process holds, as Retire would, then forget having served.

        The marks are set under the lock before any hook runs, and the hooks run outside it
        (a Resume can always abandon the restore meanwhile: its retires still go on to their
        end, as a Retire's do). Cut short by the deadline or failing, the restore fails; the
        episodes stay retired."""
        # Admission is closed by now: what the participant holds can only shrink, and a
        # refreshed list names everything (a copy older than the close could miss a session
        # seeded just before it, left running beside the install).
        await machine.participant.refresh()
        async with machine.lock:
            held, pending = machine.begin_discard(self)
            if held:
                discard.mark(held)
        with machine.observer.phase("discard"):
            if pending:
                # Installed by an earlier restore and never used: no request of them can be
                # late, and a mark would refuse the very attempts this restore may install
                # again (an earlier recovery try of the same checkpoint left them here).
                await call_hook("discard_installed", machine.participant.discard_installed(pending))
            if held:
                await discard.free(held, self.deadline, wait_for_install=False)
        async with machine.lock:
            machine.finish_discard(self)

    async def _undo_install(
        self, participant: Participant, records: Sequence[RestoredRecord]
    ) -> None:
        episodes = [r.restored_as for r in records]
        try:
            await participant.discard_installed(episodes)
        except Exception as exc:
            # Nothing else can free it now; the process reports itself as having served, so
            # it refuses further restores rather than installing over leftovers.
            log.error(
                "restore %s failed and its installed state could not be freed (%s)",
                self.checkpoint_id,
                type(exc).__name__,
                exc_info=exc,
                extra={"checkpoint_id": self.checkpoint_id},
            )

    def _read_selected(
        self, participant: Participant, storage: CheckpointStorage
    ) -> tuple[StoredManifest, list[RestoredRecord]]:
        """The part's manifest and the records of the scope, ready to install (in a thread:
        it does I/O, and turning thousands of parsed records into `RestoredRecord`s is no
        work for the event loop). Each kept record's equal short strings are shared as it
        is decoded, and glibc's free heap is returned at the end: restored_memory.py."""
        wanted = {e.capture_key for e in self.scope}
        kind = participant.kind.value
        part = layout.part_path(self.checkpoint_dir, kind, participant.instance)
        seen: set[object] = set()
        strings = StringTable()
        episodes: list[EpisodeId] = []

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
            identity = participant.record_identity(episode, record)
            if identity in seen:
                raise corrupt_checkpoint(f"two records of episode {key}", part, capture_key=key)
            seen.add(identity)
            if (key in wanted or is_outbox_record(record)) and episode.attempt >= MAX_ATTEMPT:
                raise rejected_checkpoint(
                    f"episode {key} is at the highest attempt: it has no next attempt to restore as",
                    path=part,
                    capture_key=key,
                )
            if key not in wanted and not is_outbox_record(record):
                return False  # the outbox is the participant's, not an episode's: always kept
            # Kept: its episode parsed once (the restored record takes it over), and its
            # equal short strings shared with the records before it while it is fresh, so
            # the copies it drops are reused by the next record's decode (restored_memory.py).
            episodes.append(episode)
            strings.share(record)
            return True

        with collection_paused():  # decoded records are all kept: see collector.py
            manifest, raw = storage.read_part(
                self.checkpoint_dir, kind, participant.instance, select
            )
            # The storage keeps exactly the records `select` accepted, in their order.
            records = [restored_record(r, e) for r, e in zip(raw, episodes, strict=True)]
        strings.clear()
        episodes.clear()
        del raw
        release_free_heap()  # the reading's buffers and the table are freed by now
        return manifest, records
