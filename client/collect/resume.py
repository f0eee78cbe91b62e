"""Setting up the fleet before the first dispatch: restore `LATEST` into the fleet, then
retire and restart every rollout that was dispatched but is neither finished nor continued.

`LATEST` is restored into the fleet as it is found, all or nothing, and each continued rollout
is re-sent as attempt N+1, continuing from its boundary. A fleet of fresh processes (every
member started closed and awaits its restore) takes a plain Restore. A fleet with members
that kept running (only the collector died, or some members were replaced) takes a rejoining
Restore (`rejoin`): every survivor first retires what it holds, so a rollout that went on
without its collector is rolled back to its checkpointed boundary instead of restarting from
its input. A survivor may still carry requests of an attempt the dead collector sent after
the checkpoint; reusing that attempt's number for the restored N+1 would let them in, so on a
fleet with survivors a rollout is continued only if no later attempt was ever dispatched
(else it restarts). Either way every rollout that was dispatched but is neither finished nor
continued is retired (every attempt up to the highest that may exist) and restarted from its
input as a later attempt. A continued rollout whose attempt N finished after the checkpoint
and before the crash is finished by the result `take_back` takes from the entry's outbox: its
restored N+1 is never sent, and is retired once the rollout's line is durable
(`RolloutBook.unsent_restores`), else it would stay a live session on every member. A failed
restore restarts its rollouts the same way. A checkpoint published by an earlier run than the
last one that dispatched is not restored: that later run may have re-sent its continuations.
A prompt group one of whose rollouts the crash cut (continued or restarted) follows its
policy (`groups`): `sibling` keeps the finished siblings taken back from the outbox; `group`
retires and restarts every sibling not in the output, continued and taken back ones
included, from its input as a later attempt.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import restore_published
from rollout_checkpoint.client.checkpointing.fanout import FleetError, awaiting_restore
from rollout_checkpoint.client.checkpointing.publication import PublicationError, PublicationRoot
from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.collect.control import BATCH, ControlCalls
from rollout_checkpoint.client.collect.journal import Previous, attempts_in
from rollout_checkpoint.client.collect.rollouts import RolloutBook, Status
from rollout_checkpoint.client.collect.staleness import StaleHandling
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.client.recovery import end_cut_checkpoints
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId
from rollout_checkpoint.v1 import participant_service_pb2 as pb


class FleetSetup:
    """Brings a discovered fleet and the book to where dispatching may start (see the
    module doc). `run` raises `FleetError`/`ControlError` when the fleet cannot be opened or
    a Retire fails (the run cannot start safely); a failed restore is not an error."""

    def __init__(
        self,
        fleet: Fleet,
        root: PublicationRoot,
        book: RolloutBook,
        view: CollectView,
        control: ControlCalls,
        stale: StaleHandling | None = None,
    ) -> None:
        self.fleet = fleet
        self.root = root
        self.book = book
        self.view = view
        self.control = control
        self.stale = stale

    async def run(
        self,
        previous: Previous,
        deadline: float,
        take_back: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Restore, reopen and retire as needed (every call by `deadline`, a `time.time()`),
        then queue every pending rollout. `take_back` runs once the fleet is restored or
        reopened and before any unfinished rollout is retired: it takes the results the
        entry holds (receipts.py), which a Retire of their rollouts would release."""
        state = previous.state or {}
        # Every attempt of an unfinished rollout that may hold state somewhere.
        top: dict[str, int] = dict(previous.dispatched)
        for rollout_id, attempt in attempts_in(state.get("attempts")).items():
            top[rollout_id] = max(top.get(rollout_id, 0), attempt)
        self.book.apply_marks(state)
        if previous.problem is not None:
            self.view.note(f"collect: {previous.problem}; nothing is restored")
        restored = False
        if previous.manifest is not None and previous.state is not None:
            restored = await self._maybe_restore(previous, top, deadline)
        if not restored:
            await self._reopen(deadline)
        if take_back is not None:
            await take_back()
        await self._restart_unfinished(top, deadline)
        if self.stale is not None:
            await self.stale.drop_pending()
        self.book.queue_pending()

    async def _maybe_restore(
        self, previous: Previous, top: dict[str, int], deadline: float
    ) -> bool:
        """Restore `LATEST` when the checkpoint is the last run's and continues something
        (rejoining the members that kept running); raise `top` to every N+1 a restore may
        have created."""
        manifest, state = previous.manifest, previous.state
        assert manifest is not None and state is not None
        statuses = await fanout.fan_out(
            "status", self.fleet.members, lambda m: m.client.get_status(), self.fleet.spec.fan_out
        )
        survivors = not all(awaiting_restore(s) for s in statuses.values())
        rollouts = self.book.rollouts
        scope = [
            e
            for e in manifest.continued
            if e.rollout_id in rollouts
            and rollouts[e.rollout_id].status is Status.PENDING
            and e.attempt < MAX_ATTEMPT
            and not (survivors and self._later_attempt_sent(e, top))
        ]
        for episode in manifest.continued:
            if episode.attempt < MAX_ATTEMPT:
                top[episode.rollout_id] = max(top.get(episode.rollout_id, 0), episode.attempt + 1)
        name = manifest.checkpoint_id
        if previous.runs and previous.runs[-1] != state.get("run_id"):
            self.view.note(
                f"collect: run {previous.runs[-1]} dispatched after checkpoint {name}: "
                "nothing is restored"
            )
        elif not scope:
            self.view.note(f"collect: checkpoint {name} continues no unfinished rollout")
        else:
            return await self._restore(name, scope, deadline, statuses if survivors else None)
        return False

    def _later_attempt_sent(self, episode: EpisodeId, top: Mapping[str, int]) -> bool:
        """Whether an attempt after `episode`'s was dispatched or retired (may still have
        requests on their way between survivors)."""
        rollout = self.book.rollouts[episode.rollout_id]
        return max(top.get(episode.rollout_id, 0), rollout.highest_used) > episode.attempt

    async def _restore(
        self,
        name: str,
        scope: list[EpisodeId],
        deadline: float,
        survivors: Mapping[str, pb.GetStatusResponse] | None,
    ) -> bool:
        """Restore checkpoint `name` continuing `scope`; `survivors` (the members' statuses)
        when some member kept running: the restore then rejoins them, after ending any
        checkpoint the dead collector left open there (Restore is refused inside one)."""
        restore_id = self.control.new_id("restore")
        self.book.counts.phase = f"restoring {name}"
        try:
            if survivors is not None:
                await end_cut_checkpoints(self.fleet, survivors, restore_id, deadline)
            await restore_published(
                self.fleet,
                self.root,
                restore_id,
                deadline,
                source=name,
                scope=scope,
                rejoin=survivors is not None,
                trigger=Trigger.MANUAL,
            )
        except FleetError as error:
            # All or nothing: the library retired every N+1 and resumed the fleet.
            self.view.note(
                f"collect: restore of {name} failed ({error}); its {len(scope)} rollout(s) "
                "restart from their inputs as later attempts"
            )
            return False
        except PublicationError as error:
            self.view.note(f"collect: checkpoint {name} cannot be restored ({error})")
            return False
        await fanout.resume(self.fleet, restore_id, deadline)
        not_continued = (
            await self.stale.screen(self.fleet, [e.next_attempt() for e in scope])
            if self.stale is not None
            else set()
        )
        for episode in scope:
            if episode.rollout_id not in not_continued:  # the others restart (or are dropped)
                self.book.continues(
                    self.book.rollouts[episode.rollout_id], episode.attempt + 1, name
                )
        into = "the fleet, its survivors rejoining" if survivors is not None else "a fresh fleet"
        self.view.note(
            f"collect: restored {name} into {into}: {len(scope)} rollout(s) continue as attempt N+1"
        )
        return True

    async def _reopen(self, deadline: float) -> None:
        """Resume every member: a fleet started closed opens, and a checkpoint a crashed
        collector left open (its fleet kept running) is ended, so Retire is allowed."""
        fleet = self.fleet
        statuses = await fanout.fan_out(
            "status", fleet.members, lambda m: m.client.get_status(), fleet.spec.fan_out
        )
        fresh = self.control.new_id("open")
        for _, members in reversed(fleet.stages()):
            await fanout.fan_out(
                "resume",
                members,
                lambda m: m.client.resume(statuses[m.name].checkpoint_id or fresh, deadline),
                fleet.spec.fan_out,
            )

    async def _restart_unfinished(self, top: dict[str, int], deadline: float) -> None:
        """Retire every dispatched, unfinished, not continued rollout up to its highest
        attempt, so it restarts from its input as a later one; and so every sibling of a
        `group` group the crash cut (taken back or continued ones too)."""
        book = self.book
        cut = [
            r
            for r in book.rollouts.values()
            if r.status is Status.PENDING and (r.continued or r.rollout_id in top)
        ]
        regenerated = {r.rollout_id for r in book.cut(r.rollout_id for r in cut)}
        restart: list[EpisodeId] = []
        for rollout in book.rollouts.values():
            if rollout.rollout_id not in regenerated and (
                rollout.status is not Status.PENDING or rollout.continued
            ):
                continue
            highest = max(top.get(rollout.rollout_id, -1), rollout.highest_used)
            if highest < 0:
                continue  # never dispatched: attempt 0 is new everywhere
            restart.append(EpisodeId(rollout.rollout_id, highest))
        for start in range(0, len(restart), BATCH):
            batch = restart[start : start + BATCH]
            await fanout.retire(self.fleet, self.control.new_id("retire"), deadline, batch)
            for episode in batch:
                rollout = book.rollouts[episode.rollout_id]
                book.retired(rollout, episode.attempt)
                book.regenerate(rollout, episode.attempt)
        if restart:
            self.view.note(
                f"collect: retired {len(restart)} dispatched, unfinished rollout(s); they "
                "restart from their inputs as later attempts"
            )
