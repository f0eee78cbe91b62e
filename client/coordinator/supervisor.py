"""The supervisor: periodic checkpoints, and the fleet restored by itself when a member is replaced.

`rollout-checkpoint coordinator --fleet F --grpc-address A --supervise` runs it beside
CoordinatorService. Like a Flink job under a restart strategy, the fleet recovers from its
latest completed checkpoint with no person involved. The rules, each for a failure:

* **One action at a time.** Checkpoints and recoveries run on one loop, one after the other:
  a checkpoint racing a recovery would prepare members that are being restored, and two
  recoveries racing would restore the fleet twice.
* **Replacements are seen, not guessed** (`membership.FleetWatch`: health streams and boot
  ids). A member with a new boot id lost its state, so the whole fleet goes back to `LATEST`
  (`recovery.recover`, all or nothing). A member that is down is waited for; nothing is
  checkpointed meanwhile (a checkpoint without it would be unsafe to restore).
* **The coordinator keeps no state, and mends what a dead one left** (`mending`): on start,
  and for each member that comes back with the same boot id, every member's state is read and
  whatever a dead controller left is finished (a recovery) or undone (a cut checkpoint
  resumed). Otherwise the fleet would stay closed until the lease expires.
* **A restart strategy bounds the tries** (`restart_strategy`: `max_tries` within a window, a
  replacement dying before its recovery finished counted as a failed try, a doubling backoff
  after a failed one). A try that fails leaves the members as they are (a retry replays
  where it succeeded); when the limit is reached the last try is undone all or nothing
  (every member it left RESTORED has the attempts N+1 retired and is resumed; members started
  closed stay closed, so no empty member joins the fleet), the supervisor stops acting, and
  `recovery_given_up` says why. A coordinator restarted by hand starts with a fresh strategy.
* **Another supervisor cannot corrupt anything**: a recovery's id is derived from the
  checkpoint and the boot ids (`recovery.recovery_id`), so two supervisors send the same calls
  and the members replay them, and a recovery that lost a race undoes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    open_checkpoint_root,
    store_call,
)
from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.coordinator.calls import encodable, status_of
from rollout_checkpoint.client.coordinator.fleet_events import FleetEventLog
from rollout_checkpoint.client.coordinator.mending import mend
from rollout_checkpoint.client.coordinator.periodic_checkpoints import PeriodicCheckpoints
from rollout_checkpoint.client.coordinator.restart_strategy import RecoveryTries, RestartStrategy
from rollout_checkpoint.client.fleet import DiscoveryError, Fleet, FleetSpec
from rollout_checkpoint.client.fleet.membership import Change, FleetWatch, MemberEvent
from rollout_checkpoint.client.recovery import (
    Recovery,
    RecoveryLostRace,
    StepHook,
    no_pause,
    recover,
    recovery_id,
    undo_unfinished_recovery,
)
from rollout_checkpoint.server.core.rpc.wire import duration, episode_message
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

__all__ = [
    "PAUSE_AT_VARIABLE",
    "RECOVERY_ANNOUNCED",
    "RestartStrategy",
    "Supervisor",
    "SupervisorSettings",
    "pause_at",
]

log = logging.getLogger(__name__)

RECOVERY_ANNOUNCED = "recovery-announced"
"""The `StepHook` point after a recovery's `recovery_finished` went out, before the supervisor
forgets the replacements it restored."""


@dataclass(frozen=True)
class SupervisorSettings:
    """`--supervise` and the flags beside it."""

    checkpoint_every: float | None = 300.0
    """Seconds between supervisor checkpoints (None: recover only, never checkpoint)."""
    checkpoint_seconds: float = 120.0
    """The deadline of one checkpoint (prepare, commit, publish)."""
    recovery_seconds: float = 120.0
    """The deadline of one recovery try (restore and resume), and how long it waits for a
    member that is down before the try counts as failed."""
    strategy: RestartStrategy = field(default_factory=RestartStrategy)
    """How many recovery tries before the supervisor gives up."""
    step: StepHook = no_pause
    """Awaited at each point between the steps of a recovery or a checkpoint (tests kill the
    supervisor there: `coordinator --supervise` pauses at the point that
    `ROLLOUT_CHECKPOINT_TEST_PAUSE_AT` names)."""


PAUSE_AT_VARIABLE = "ROLLOUT_CHECKPOINT_TEST_PAUSE_AT"


def pause_at(point: str) -> StepHook:
    """A `StepHook` that stops the supervisor for good at `point` (a `recovery.Step` or a
    `periodic_checkpoints.CHECKPOINT_STEPS` name), logging "supervisor: paused at <point>"
    first: tests kill the coordinator process there, deterministically, to check that its
    successor mends the fleet (`coordinator --supervise` with
    `ROLLOUT_CHECKPOINT_TEST_PAUSE_AT` set)."""

    async def pause(reached: str) -> None:
        if reached == point:
            log.warning("supervisor: paused at %s (%s)", point, PAUSE_AT_VARIABLE)
            await asyncio.Event().wait()

    return pause


class GaveUp(Exception):
    """The restart strategy's limit was reached while waiting for members."""


class Supervisor:
    """Supervises one fleet until `stop` (see the module docstring)."""

    def __init__(
        self,
        spec: FleetSpec,
        events: FleetEventLog,
        settings: SupervisorSettings,
        *,
        discover: Callable[[FleetSpec], Awaitable[Fleet]] = Fleet.discover,
    ) -> None:
        if spec.checkpoint_root is None:
            raise ValueError("--supervise needs checkpoint_root in the fleet file")
        self.spec = spec
        self.root = open_checkpoint_root(spec.checkpoint_root)
        self.events = events
        self.settings = settings
        self._discover = discover
        self._wake = asyncio.Event()
        self._replaced: dict[str, float] = {}
        """Members replaced and not yet recovered, with when the first sign was seen."""
        self._down_since: dict[str, float] = {}
        self._to_check: set[str] = set()
        """Members whose state is to be read (`mending.mend`): all on start, and each that
        comes back with the same boot id."""
        self._tries = RecoveryTries(settings.strategy, events)
        self._checkpoints = PeriodicCheckpoints(
            spec,
            self.root,
            events,
            seconds=settings.checkpoint_seconds,
            step=settings.step,
            discover=discover,
        )
        self._next_checkpoint = time.monotonic() + (settings.checkpoint_every or 0.0)
        self.watch = FleetWatch(spec, self._on_member)
        self._task: asyncio.Task[None] | None = None
        self.given_up: str | None = None
        """Why the supervisor stopped acting (None while it supervises)."""
        self.recoveries: list[Recovery] = []

    async def start(self) -> None:
        self.watch.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.watch.close()

    # -- what the watch reports ---------------------------------------------------------

    def _on_member(self, event: MemberEvent) -> None:
        self.events.member_changed(event)
        if event.change is Change.DOWN:
            self._down_since.setdefault(event.name, event.at)
            if event.name in self._replaced and event.boot_id:
                self._tries.replacement_died(event, counting=self.given_up is None)
        elif event.change is Change.REPLACED:
            first = self._down_since.pop(event.name, event.at)
            self._replaced.setdefault(event.name, first)
        else:
            if self._down_since.pop(event.name, None) is not None:
                # Back with the same boot id: a call of ours may have missed it (a Resume
                # that left it closed while its neighbours reopened).
                self._to_check.add(event.name)
        self._wake.set()

    # -- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        await self._wait_for_discovery()
        self._to_check = {m.name for m in self.spec.members}
        on_start = True
        while self.given_up is None:
            try:
                if self._to_check:
                    await self._check_members(on_start=on_start)
                    on_start = False
                elif self._replaced:
                    await self._recover()
                elif self._checkpoint_due():
                    await self._checkpoint()
                else:
                    await self._sleep_until_next()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive any one action's bug
                log.exception("supervisor: an action failed; going on")
                await asyncio.sleep(1.0)

    async def _sleep_until_next(self) -> None:
        self._wake.clear()
        timeout = None
        if self.settings.checkpoint_every is not None:
            timeout = max(0.0, self._next_checkpoint - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _checkpoint_due(self) -> bool:
        return (
            self.settings.checkpoint_every is not None and time.monotonic() >= self._next_checkpoint
        )

    async def _wait_for_discovery(self) -> None:
        """Wait until every member answers once (a fleet that is still starting)."""
        wait = 0.5
        while True:
            try:
                fleet = await self._discover(self.spec)
                break
            except DiscoveryError as error:
                log.warning("supervisor: waiting for every member to answer (%s)", error)
                await asyncio.sleep(wait)
                wait = min(10.0, wait * 2)
        await fleet.close()

    async def _check_members(self, *, on_start: bool) -> None:
        """Mend the members in `_to_check` (`mending.mend`): each found awaiting a recovery
        is replaced from then on."""
        names = sorted(self._to_check)
        self._to_check.clear()
        await mend(
            self.spec,
            names,
            on_start=on_start,
            own_checkpoints=self._checkpoints.own,
            resume_seconds=self.settings.checkpoint_seconds,
            awaits_recovery=self._awaits_recovery,
        )

    def _awaits_recovery(self, name: str) -> None:
        """A member found awaiting its recovery: replaced from this moment on."""
        self._replaced.setdefault(name, time.time())

    # -- checkpoints ----------------------------------------------------------------------

    async def _checkpoint(self) -> None:
        assert self.settings.checkpoint_every is not None
        self._next_checkpoint = time.monotonic() + self.settings.checkpoint_every
        if self.watch.down():
            log.info("supervisor: checkpoint skipped, members down: %s", sorted(self.watch.down()))
            return
        held = await self._checkpoints.take()
        for name in held.awaiting_restore:  # recovered before anything else
            self._replaced.setdefault(name, self._down_since.get(name, time.time()))
        self._to_check.update(held.elsewhere)

    # -- recoveries -----------------------------------------------------------------------

    async def _recover(self) -> None:
        """One recovery try, or giving up when the strategy's limit is reached.

        A replaced member lost its state whether or not it started closed (a replacement
        started open, or opened by a Resume, holds nothing of the fleet's state either), so
        every replacement leads to a recovery; one that another supervisor already finished
        is recognized by its id and only completed (`recovery.recover`)."""
        if self._tries.exhausted():
            await self._give_up()
            return
        now = time.time()
        first_sign = min(self._replaced.values())
        deadline = now + self.settings.recovery_seconds
        try:
            await self._wait_for_members(deadline)
            fleet = await self._discover(self.spec)
        except GaveUp:
            await self._give_up()
            return
        except (DiscoveryError, TimeoutError) as error:
            await self._tries.failed(self._tries.start(now, self._replaced), error)
            return
        async with fleet:
            try:
                latest = await store_call(deadline, self.root.location, self.root.latest)
            except PublicationError as error:
                await self._tries.failed(self._tries.start(now, self._replaced), error)
                return
            boot_ids = {m.name: m.boot_id for m in fleet.members}
            self._tries.trying(boot_ids[name] for name in self._replaced)
            try_number = self._tries.start(
                now, self._replaced, latest, recovery_id(latest, boot_ids)
            )
            try:
                recovery = await recover(
                    fleet, self.root, deadline, step=self.settings.step, trigger=Trigger.SUPERVISOR
                )
            except (FleetError, PublicationError, RecoveryLostRace) as error:
                await self._tries.failed(try_number, error)
                return
            # Announced in the turn the resume returned, before anything else is awaited: a
            # supervisor killed later leaves an open fleet whose recovery was announced, one
            # killed earlier leaves it RESTORED for its successor to finish and announce.
            self._announce(recovery, first_sign)
        await self.settings.step(RECOVERY_ANNOUNCED)
        self._recovered(boot_ids)
        # Checkpoint the recovered fleet at once: until a checkpoint names the restored
        # attempts N+1, a second crash could only restore N+1 again, which the survivors that
        # already ran it have retired.
        self._next_checkpoint = time.monotonic()

    def _recovered(self, boot_ids: dict[str, str]) -> None:
        """Forget the replacements this try restored, and only those: a member replaced
        again while the try ran, or first replaced then (its boot id is no longer the one
        the try restored), still awaits its recovery; forgotten, it would stay closed until
        its start-closed timeout opened it empty."""
        current = self.watch.boot_ids()
        for name in list(self._replaced):
            restored = boot_ids.get(name)
            # Not seen by the watch yet (a member found closed at start-up): the try's own
            # read is the newest there is.
            if restored is not None and current.get(name, restored) == restored:
                del self._replaced[name]
        if not self._replaced:
            self._tries.all_recovered()

    def _announce(self, recovery: Recovery, first_sign: float) -> None:
        self.recoveries.append(recovery)
        seconds = max(0.0, time.time() - first_sign)
        self.events.emit(
            recovery_finished=cpb.RecoveryFinished(
                recovery_id=recovery.recovery_id,
                source_checkpoint_id=recovery.source_checkpoint_id or "",
                continued=[episode_message(e) for e in recovery.continued],
                restarted=[episode_message(e) for e in recovery.restarted],
                controller_state=recovery.controller_state,
                duration=duration(seconds),
            )
        )
        log.info(
            "supervisor: fleet recovered from %s in %.2f s: %d continued, %d to restart",
            recovery.source_checkpoint_id or "(no checkpoint: opened)",
            seconds,
            len(recovery.continued),
            len(recovery.restarted),
        )

    async def _wait_for_members(self, deadline: float) -> None:
        """Wait until every member answers; raises `GaveUp` when replacements that died
        meanwhile exhausted the strategy, `TimeoutError` at `deadline`."""
        while self.watch.down() or set(self._replaced) - set(self.watch.boot_ids()):
            if self._tries.exhausted():
                raise GaveUp
            remaining = deadline - time.time()
            if remaining <= 0:
                raise TimeoutError(f"members still down: {', '.join(sorted(self.watch.down()))}")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)

    async def _give_up(self) -> None:
        text = self._tries.limit_reached(self._replaced)
        error = self._tries.last_error
        self.given_up = text
        await self._undo_last_try()
        log.error("supervisor: giving up: %s", text)
        event = cpb.RecoveryGivenUp(reason=text)
        if error is not None:
            event.error.CopyFrom(status_of(encodable(error)))
        self.events.emit(recovery_given_up=event)

    async def _undo_last_try(self) -> None:
        """All or nothing: no member may stay with half a restore (best effort)."""
        deadline = time.time() + self.settings.recovery_seconds
        undone = await undo_unfinished_recovery(self.spec, self.root, deadline)
        if undone:
            log.warning("supervisor: undid the unfinished recovery on %s", ", ".join(undone))
