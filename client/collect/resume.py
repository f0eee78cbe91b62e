"""Setting up the fleet before the first dispatch: restore `LATEST` into a restarted fleet,
then retire and restart every rollout that was dispatched but is neither finished nor
continued.

If the fleet was restarted (its boot ids differ from the checkpoint's), `LATEST` is restored
into it, all or nothing, and each continued rollout is re-sent as attempt N+1, continuing from
its boundary. If the fleet kept running (same boot ids) there is nothing to restore into.
Either way every rollout that was dispatched but is neither finished nor continued is retired
(every attempt up to the highest that may exist) and restarted from its input as a later
attempt. A failed restore restarts its rollouts the same way. A checkpoint published by an
earlier run than the last one that dispatched is not restored: that later run may have
re-sent its continuations.
"""

from __future__ import annotations

from rollout_checkpoint.client import coordination
from rollout_checkpoint.client.checkpointing import restore_published
from rollout_checkpoint.client.collect.control import BATCH, ControlCalls
from rollout_checkpoint.client.collect.journal import Previous, attempts_in
from rollout_checkpoint.client.collect.rollouts import RolloutBook, Status
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.coordination import FleetError
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.client.publication import PublicationError, PublicationRoot
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId


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
    ) -> None:
        self.fleet = fleet
        self.root = root
        self.book = book
        self.view = view
        self.control = control

    async def run(self, previous: Previous, deadline: float) -> None:
        """Restore, reopen and retire as needed (every call by `deadline`, a `time.time()`),
        then queue every pending rollout."""
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
        await self._restart_unfinished(top, deadline)
        self.book.queue_pending()

    async def _maybe_restore(
        self, previous: Previous, top: dict[str, int], deadline: float
    ) -> bool:
        """Restore `LATEST` when the fleet is a fresh one and the checkpoint is the last run's
        and continues something; raise `top` to every N+1 a restore may have created."""
        manifest, state = previous.manifest, previous.state
        assert manifest is not None and state is not None
        rollouts = self.book.rollouts
        scope = [
            e
            for e in manifest.continued
            if e.rollout_id in rollouts
            and rollouts[e.rollout_id].status is Status.PENDING
            and e.attempt < MAX_ATTEMPT
        ]
        for episode in manifest.continued:
            if episode.attempt < MAX_ATTEMPT:
                top[episode.rollout_id] = max(top.get(episode.rollout_id, 0), episode.attempt + 1)
        current = {m.name: m.boot_id for m in self.fleet.members}
        name = manifest.checkpoint_id
        if previous.runs and previous.runs[-1] != state.get("run_id"):
            self.view.note(
                f"collect: run {previous.runs[-1]} dispatched after checkpoint {name}: "
                "nothing is restored"
            )
        elif state.get("boot_ids") == current:
            self.view.note(
                f"collect: the fleet kept running since checkpoint {name} (same boot ids): "
                "nothing to restore into"
            )
        elif not scope:
            self.view.note(f"collect: checkpoint {name} continues no unfinished rollout")
        else:
            return await self._restore(name, scope, deadline)
        return False

    async def _restore(self, name: str, scope: list[EpisodeId], deadline: float) -> bool:
        restore_id = self.control.new_id("restore")
        self.book.counts.phase = f"restoring {name}"
        try:
            await restore_published(
                self.fleet, self.root, restore_id, deadline, source=name, scope=scope
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
        await coordination.resume(self.fleet, restore_id, deadline)
        for episode in scope:
            self.book.continues(self.book.rollouts[episode.rollout_id], episode.attempt + 1)
        self.view.note(f"collect: restored {name}: {len(scope)} rollout(s) continue as attempt N+1")
        return True

    async def _reopen(self, deadline: float) -> None:
        """Resume every member: a fleet started closed opens, and a checkpoint a crashed
        collector left open (its fleet kept running) is ended, so Retire is allowed."""
        fleet = self.fleet
        statuses = await coordination.fan_out(
            "status", fleet.members, lambda m: m.client.get_status(), fleet.spec.fan_out
        )
        fresh = self.control.new_id("open")
        for _, members in reversed(fleet.stages()):
            await coordination.fan_out(
                "resume",
                members,
                lambda m: m.client.resume(statuses[m.name].checkpoint_id or fresh, deadline),
                fleet.spec.fan_out,
            )

    async def _restart_unfinished(self, top: dict[str, int], deadline: float) -> None:
        """Retire every dispatched, unfinished, not continued rollout up to its highest
        attempt, so it restarts from its input as a later one."""
        restart: list[EpisodeId] = []
        for rollout in self.book.rollouts.values():
            if rollout.status is not Status.PENDING or rollout.continued:
                continue
            highest = top.get(rollout.rollout_id)
            if highest is None:
                continue  # never dispatched: attempt 0 is new everywhere
            restart.append(EpisodeId(rollout.rollout_id, highest))
        for start in range(0, len(restart), BATCH):
            batch = restart[start : start + BATCH]
            await coordination.retire(self.fleet, self.control.new_id("retire"), deadline, batch)
            for episode in batch:
                rollout = self.book.rollouts[episode.rollout_id]
                self.book.retired(rollout, episode.attempt)
                rollout.attempt = episode.attempt + 1
        if restart:
            self.view.note(
                f"collect: retired {len(restart)} dispatched, unfinished rollout(s); they "
                "restart from their inputs as later attempts"
            )
