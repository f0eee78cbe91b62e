"""Recovering a running collection in place when a member of its fleet dies.

A member that dies takes its part of every rollout in flight with it; a replacement (started
closed on the same addresses, as Kubernetes restarts a pod) holds nothing. The collector sees
it through `membership.FleetWatch` (health streams and boot ids), restores the latest
checkpoint of this run into the whole fleet, survivors included (`recovery.recover`: a
rejoining Restore), and goes on, without exiting: `--resume` stays for a crash of the
collector itself. Every rule below exists for a crash or a race at the step before it:

* **Dispatching stops the moment a member is seen lost** (down, or answering with a new boot
  id): an attempt sent now would run against a member that lost its state, or hang at a
  boundary waiting for it.
* **A failure of an attempt the loss cut is not the rollout's** (`RolloutBook.member_lost`,
  `attempt_failed`): a tool call to a dead resources server fails the episode (502), a rejoin
  retires the episodes the survivors held (409 `stale_attempt`). Counted, they would record
  rollouts as failed for a crash they had no part in; so they are neither counted against
  `--max-attempts` nor written to the output, and the failures not yet retired when the loss
  is seen are uncounted too (their reply can outrun the watch).
* **A member that comes back as the same process (same boot id) lost nothing**: nothing is
  restored, the cut attempts are retired and retried like failures that do not count.
* **Only a checkpoint of this run is restored** (its controller state names this run). An
  earlier run's `LATEST` may continue rollouts this run already re-sent; with no checkpoint of
  this run there is nothing to restore: the rollouts in flight are retired everywhere *before*
  the replacement is opened (else the survivors' episodes would go on against a member that
  lost its part of them) and restart from their inputs.
* **A rollout is continued only if no later attempt was ever used** (`RolloutBook.continuable`):
  a retried or already continued attempt may still have requests on their way between the
  survivors, and reusing its number for the restored N+1 would let them in. Such rollouts
  restart instead, and the attempts a restore is about to install count as used before it
  starts, so a restore that fails half way is never continued from.
* **Everything that may still run is retired before it is sent again** (`RolloutBook.may_run`),
  up to the highest attempt ever used: the rejoin retires only what the survivors hold, not a
  late request that reaches the fresh member. The new attempts go through the dispatch log
  (written ahead) like every other, so a crash of the collector during a recovery leaves
  `--resume` everything it needs: the dispatch log, the output and the unchanged `LATEST`.
* **A prompt group the loss cut follows its policy** (`groups`): `sibling` keeps its
  finished siblings; `group` is excluded from the restore's scope, and every sibling not yet
  written, finished ones included, is retired and restarted from its input.
* **The requests the loss cut are awaited before anything is re-sent** (they end with
  `stale_attempt` once retired, at most `IN_FLIGHT_SECONDS`, then they are dropped): a rollout
  has one request in flight at a time, and a late reply of a cut attempt must not be taken for
  the new one's.
* **The fleet is discovered again** before a recovery: the clients then carry the
  replacement's boot id, and the recovery's id (derived from the boot ids) is this fleet's.
* **A replacement must start closed** (`--start-closed`, as a pod restarted on the same
  address does in the Kubernetes manifests): until the recovery retired the survivors'
  episodes, a replacement that admitted traffic could serve them with none of their state.
* **The tries are bounded** (`max_recoveries`, every try counted, a failed one too): a member
  in a crash loop stops the run as a SIGTERM does, with the `--resume` command, instead of
  recovering forever. A member that stays down longer than the timeout stops it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import FleetError, fan_out
from rollout_checkpoint.client.checkpointing.publication import (
    FleetManifest,
    PublicationError,
    PublicationRoot,
    store_call,
)
from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.collect.checkpoints import CheckpointStepHook
from rollout_checkpoint.client.collect.control import BATCH, ControlCalls
from rollout_checkpoint.client.collect.journal import collect_state, read_latest_manifest
from rollout_checkpoint.client.collect.receipts import owe_what_the_restore_holds_again
from rollout_checkpoint.client.collect.rollouts import RolloutBook, Status
from rollout_checkpoint.client.collect.staleness import StaleHandling
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, Fleet, FleetSpec
from rollout_checkpoint.client.fleet.membership import Change, FleetWatch, MemberEvent
from rollout_checkpoint.client.recovery import (
    RecoveryLostRace,
    end_cut_checkpoints,
    open_fresh,
    recover,
)
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.v1 import participant_service_pb2 as pb

IN_FLIGHT_SECONDS = 30.0
"""How long a recovery waits for the requests the loss cut to end once their attempts are
retired (they answer `stale_attempt` within a second or two) before it drops them."""
RETRY_SECONDS = 1.0
"""The pause before another try when one failed and no member is down."""

Settle = Callable[[float], Awaitable[int]]
"""Waits up to the given seconds for every request in flight to end, cancels the rest and
returns how many it cancelled (`Dispatcher.settle_in_flight`)."""


class GaveUp(Exception):
    """The collection cannot go on in place: a member stayed down past the timeout, or was
    lost more often than `max_recoveries` allows. The message says which and why."""


@dataclass(eq=False)
class InPlaceRecovery:
    """Watches the fleet of one collection and recovers it in place (see the module doc).

    `on_loss` is called on the loop each time a member is seen lost (the collector closes its
    dispatch gate then); `lost` stays true until `recover` brought the fleet back. `start`
    once the fleet is set up, `close` at the end."""

    spec: FleetSpec
    root: PublicationRoot
    book: RolloutBook
    view: CollectView
    control: ControlCalls
    _: KW_ONLY
    run_id: str
    max_recoveries: int
    timeout: float
    on_loss: Callable[[], None]
    step_hook: CheckpointStepHook | None = None
    """Called at each step of each recovery try, numbered by try (`CheckpointStepHook`)."""
    stale: StaleHandling | None = None
    """`--max-policy-lag`: what a recovery continues is screened first (staleness.py)."""
    tries: int = field(default=0, init=False)
    """Recovery tries made (each counts against `max_recoveries`)."""
    _down: set[str] = field(default_factory=set, init=False)
    _replaced: dict[str, float] = field(default_factory=dict, init=False)
    """Members replaced and not recovered yet, with when it was seen (`time.time()`)."""
    _first_sign: float | None = field(default=None, init=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _watch: FleetWatch | None = field(default=None, init=False)

    def start(self, fleet: Fleet) -> None:
        """Watch every member, knowing the boot ids `fleet` was discovered with: a member
        replaced since answers with another one and is reported replaced at once."""
        known = {m.name: m.boot_id for m in fleet.members}
        self._watch = FleetWatch(self.spec, self._on_member, known=known)
        self._watch.start()

    async def close(self) -> None:
        """Stop watching; idempotent."""
        if self._watch is not None:
            await self._watch.close()
            self._watch = None

    @property
    def lost(self) -> bool:
        """A member was seen down or replaced and the fleet is not recovered yet."""
        return bool(self._down or self._replaced)

    def wake(self) -> None:
        """Something the wait for lost members must look at changed (a stop request)."""
        self._changed.set()

    def _on_member(self, event: MemberEvent) -> None:
        if event.change is Change.UP:
            if event.name in self._down:
                self._down.discard(event.name)
                self.view.note(f"collect: member {event.name} answers again (same process)")
        else:
            first = not self.lost
            if event.change is Change.DOWN:
                self._down.add(event.name)
                self.view.note(
                    f"collect: member {event.name} is down ({event.detail}); dispatching paused"
                )
            else:
                self._down.discard(event.name)
                self._replaced[event.name] = event.at
                self.view.note(
                    f"collect: member {event.name} was replaced (a new process, boot id "
                    f"{event.boot_id}): its state is lost"
                )
            if first:
                self._first_sign = event.at
            self.on_loss()
        self._changed.set()

    # -- the recovery -----------------------------------------------------------------------------

    async def recover(
        self, fleet: Fleet, settle: Settle, stopping: Callable[[], bool]
    ) -> Fleet | None:
        """Bring the fleet back once every lost member answers again, and queue the rollouts
        the loss cut (continued first). Returns the fleet to go on with (discovered again
        after a replacement: close the old one), or None when `stopping()` turned true while
        members were down (nothing was done). Raises `GaveUp`."""
        while True:
            if not await self._members_back(stopping):
                return None
            if not self._replaced:
                # Every member that went down came back as the same process: nothing lost.
                self.view.note("collect: every member is back as the same process; going on")
                self._first_sign = None
                return fleet
            if self.tries >= self.max_recoveries:
                raise GaveUp(self._gave_up_reason())
            self.tries += 1
            started = time.time()
            deadline = started + self.timeout
            names = ", ".join(sorted(self._replaced))
            self.view.note(
                f"collect: recovering in place from the loss of {names} "
                f"(try {self.tries} of {self.max_recoveries})"
            )
            try:
                fresh = await Fleet.discover(self.spec)
            except DiscoveryError as error:
                await self._failed_try(error)
                continue
            try:
                await self._recover_into(fresh, settle, deadline)
            except (FleetError, ControlError, CheckpointError, RecoveryLostRace) as error:
                await fresh.close()
                await self._failed_try(error)
                continue
            except BaseException:
                await fresh.close()
                raise
            self.control.succeeded()  # its retires went through: no backoff left from the loss
            # A member replaced during this try is not recovered by it: `lost` stays true and
            # the collector recovers again (what this try queued restarts then).
            self._replaced = {n: at for n, at in self._replaced.items() if at > started}
            if not self.lost:
                self._first_sign = None
            return fresh

    def _gave_up_reason(self) -> str:
        names = ", ".join(sorted(self._replaced))
        if self.max_recoveries == 0:
            return (
                f"member(s) {names} lost their state (replaced) and --max-recoveries 0 "
                "recovers nothing in place"
            )
        return (
            f"member(s) {names} lost again after {self.tries} recovery "
            f"tr{'y' if self.tries == 1 else 'ies'} (--max-recoveries {self.max_recoveries})"
        )

    async def _failed_try(self, error: BaseException) -> None:
        self.view.note(f"collect: recovery try {self.tries} failed ({error})")
        if not self._down:
            await asyncio.sleep(RETRY_SECONDS)

    async def _members_back(self, stopping: Callable[[], bool]) -> bool:
        """Until no member is down; False when `stopping()` turned true first. `GaveUp` when
        one stays down past the timeout."""
        deadline = time.time() + self.timeout
        while self._down and not stopping():
            remaining = deadline - time.time()
            names = ", ".join(sorted(self._down))
            if remaining <= 0:
                raise GaveUp(f"member(s) {names} did not come back within {self.timeout:g} s")
            self.book.counts.phase = f"waiting for {names}"
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return not stopping()

    async def _recover_into(self, fleet: Fleet, settle: Settle, deadline: float) -> None:
        """One try on a freshly discovered `fleet` (see the module doc for the order)."""
        book = self.book
        manifest = await self._this_runs_latest(deadline)
        continued: tuple[EpisodeId, ...] = ()
        restored_from: str | None = None
        # The loss cut every rollout that may run; a `group` group of theirs is regenerated
        # whole, so none of its siblings is continued.
        regenerated = book.cut(e.rollout_id for e in book.may_run(excluding=set()))
        if manifest is not None:
            scope = [
                e
                for e in book.continuable(manifest.continued)
                if book.rollouts[e.rollout_id] not in regenerated
            ]
            book.installing(scope)
            book.counts.phase = f"recovering: restoring {manifest.checkpoint_id}"
            try:
                recovery = await recover(
                    fleet,
                    self.root,
                    deadline,
                    source=manifest.checkpoint_id,
                    scope=scope,
                    abandon_on_failure=True,
                    step=self._step,
                    trigger=Trigger.SUPERVISOR,
                )
            except PublicationError as error:
                self.view.note(
                    f"collect: checkpoint {manifest.checkpoint_id} cannot be restored ({error}); "
                    "every rollout in flight restarts from its input"
                )
            else:
                continued, restored_from = recovery.continued, manifest.checkpoint_id
                if self.stale is not None:
                    stale = await self.stale.screen(fleet, continued)
                    continued = tuple(e for e in continued if e.rollout_id not in stale)
        control_id = self.control.new_id("recover")
        statuses: dict[str, pb.GetStatusResponse] = {}
        if restored_from is None:
            book.counts.phase = "recovering: retiring what was in flight"
            statuses = await fan_out(
                "status", fleet.members, lambda m: m.client.get_status(), fleet.spec.fan_out
            )
            await end_cut_checkpoints(fleet, statuses, control_id, deadline)
        restarted = sorted(
            {
                *book.may_run(excluding={e.rollout_id for e in continued}),
                *(
                    EpisodeId(r.rollout_id, r.highest_used)
                    for r in regenerated
                    if r.highest_used >= 0
                ),
            }
        )
        await self._retire(fleet, restarted, deadline)
        if restored_from is None:
            await open_fresh(fleet, statuses, control_id, deadline)
        book.counts.phase = "recovering: awaiting the cut requests"
        dropped = await settle(IN_FLIGHT_SECONDS)
        # A continued rollout whose reply was already on the wire finished after all: its
        # restored N+1 is never sent, so free it rather than leave it held.
        finished = [
            e
            for e in continued
            if book.rollouts[e.rollout_id].status in (Status.DONE, Status.FAILED, Status.HELD)
        ]
        await self._retire(fleet, finished, deadline)
        held_again = 0
        if restored_from is not None:
            # After the Retires: what they released is gone, what is left is the output's
            # or a held group's.
            held_again = await owe_what_the_restore_holds_again(fleet, book.ledger)
        book.recovered(continued, restarted, restored_from)
        if self.stale is not None:
            await self.stale.drop_pending()
        await self._step("recovered")
        seconds = time.time() - (self._first_sign or time.time())
        book.counts.recoveries += 1
        source = f"checkpoint {restored_from}" if restored_from else "no checkpoint"
        self.view.note(
            f"collect: recovered in place from {source} {seconds:.2f} s after the loss: "
            f"{len(continued) - len(finished)} rollout(s) continue as attempt N+1, "
            f"{len(restarted)} restart from their inputs"
            + (f" ({dropped} request(s) dropped)" if dropped else "")
            + (
                f"; {held_again} result(s) held again, already written, are acknowledged again"
                if held_again
                else ""
            )
        )

    async def _step(self, point: str) -> None:
        """The hook's call at `point` of this try (`recovery.Step` names spelt as the
        checkpoint steps are: `recovery_cut_ended`, `recovery_restored`)."""
        if self.step_hook is not None:
            self.step_hook(point.replace("-", "_"), self.tries)

    async def _this_runs_latest(self, deadline: float) -> FleetManifest | None:
        """`LATEST`'s fleet manifest when this run published it, read by `deadline`; else
        None (noted why)."""
        try:
            manifest = await store_call(
                deadline, self.root.location, read_latest_manifest, self.root
            )
        except (PublicationError, OSError, ValueError) as error:
            self.view.note(f"collect: LATEST cannot be read ({error}); nothing is restored")
            return None
        if manifest is None:
            self.view.note("collect: no checkpoint yet: nothing to restore")
            return None
        state = collect_state(manifest)
        if state is None or state.get("run_id") != self.run_id:
            self.view.note(
                f"collect: LATEST ({manifest.checkpoint_id}) is an earlier run's: nothing "
                "is restored (this run may have re-sent what it continues)"
            )
            return None
        return manifest

    async def _retire(self, fleet: Fleet, episodes: Sequence[EpisodeId], deadline: float) -> None:
        """Retire `episodes` (each up to its attempt) everywhere, in batches."""
        for start in range(0, len(episodes), BATCH):
            batch = list(episodes[start : start + BATCH])
            await fanout.retire(fleet, self.control.new_id("retire"), deadline, batch)
            for episode in batch:
                self.book.retired(self.book.rollouts[episode.rollout_id], episode.attempt)
