"""The collector's control loop: every fleet-wide action of a running collection, one at a time.

While the dispatcher sends rollouts, this one loop takes the checkpoints, recovers a lost
member, retires and forgets, one action after the other and in a fixed order of precedence.
Every rule below exists for a crash or a race at the step before it:

* **A part's fatal error ends the run first** (an output that cannot be written, a failed
  rollout that cannot be retired): going on would dispatch what cannot be recorded, or run a
  failed attempt's half-built state next to its retry.
* **A stop comes next** (SIGTERM/SIGINT): a checkpoint is taken and the fleet left closed,
  then the run says how to resume (`ending`).
* **A member lost mid-run is recovered in place** (`member_loss.InPlaceRecovery`) before any
  checkpoint (one without the lost member cannot be taken) and any retire (the lost member
  would refuse it): dispatching stops, this run's latest checkpoint is restored into the whole
  fleet (the survivors rejoin), and the rollouts it cut continue or restart, at most
  `max_recoveries` times. The alternative, exiting for a `--resume`, would stop a whole
  evaluation for one pod restart. Past that bound the run stops as on SIGTERM, but without a
  checkpoint (a fleet that lost a member's state cannot take one), and says how to resume.
  A recovery that restored attempts N+1 is followed by a checkpoint at once: until one names
  them, a second loss could continue none of them (they were used since).
* **Checkpoints are the library's, with the collector's state inside** (`checkpoints`), every
  `checkpoint_every` seconds and on SIGUSR1 (and continue); dispatching pauses while one runs,
  and stays paused after one if a member was lost meanwhile.
* **Failed rollouts are retired before they are retried** (`retirement`), only between
  checkpoints (retire is refused while one is open), after the control calls' backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.collect.checkpoints import CheckpointTaker, NumberedSteps
from rollout_checkpoint.client.collect.control import ControlCalls
from rollout_checkpoint.client.collect.dispatch import Dispatcher
from rollout_checkpoint.client.collect.ending import (
    finished_code,
    finished_note,
    gave_up_note,
    stopped_code,
    stopped_note,
)
from rollout_checkpoint.client.collect.member_loss import GaveUp, InPlaceRecovery
from rollout_checkpoint.client.collect.options import CollectOptions
from rollout_checkpoint.client.collect.retirement import Retirement
from rollout_checkpoint.client.collect.rollouts import RolloutBook
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.fleet import Fleet


@dataclass
class RunRequests:
    """What the control loop is asked to do by what runs beside it: a signal (stop, or a
    checkpoint now) or a part that cannot go on (`fatal`). Each is followed by setting
    `wake`, so the loop never sleeps through one."""

    stop: bool = False
    stop_signal: signal.Signals = signal.SIGTERM
    """The signal that asked for the stop: it chooses the exit code."""
    checkpoint: bool = False
    checkpoint_trigger: str = Trigger.SIGNAL
    """What asked for the `checkpoint` (its history record's trigger): SIGUSR1, or the
    recovery that needs its restored attempts named by a checkpoint."""
    fatal: BaseException | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class RunningParts:
    """The parts of a collection that run beside its control loop, set up before it."""

    book: RolloutBook
    view: CollectView
    control: ControlCalls
    dispatcher: Dispatcher
    recovery: InPlaceRecovery
    checkpoints: CheckpointTaker
    retirement: Retirement
    steps: NumberedSteps


class ControlLoop:
    """Runs the fleet-wide actions of one collection until it is done or stops (see the
    module doc). `fleet` is the current fleet: a recovery in place swaps it for one
    discovered again (and closes the old one); the caller closes the last. `notify` wakes
    the loop and every part waiting for a change."""

    def __init__(
        self,
        options: CollectOptions,
        fleet: Fleet,
        parts: RunningParts,
        requests: RunRequests,
        notify: Callable[[], None],
    ) -> None:
        self.options = options
        self.fleet = fleet
        self.parts = parts
        self.counts = parts.book.counts
        self.requests = requests
        self.notify = notify
        self.stopped = False
        """The run stopped before every rollout was collected (a signal, a lost member)."""

    async def run(self) -> int:
        """Until every rollout is done (the exit code says whether some failed), or a stop.
        Raises a part's fatal error."""
        book, control, requests = self.parts.book, self.parts.control, self.requests
        every = self.options.checkpoint_every
        next_at = time.monotonic() + every if every else None
        while True:
            if requests.fatal is not None:
                raise requests.fatal
            now = time.monotonic()
            if requests.stop:
                return await self._stop()
            if self.parts.recovery.lost and not book.all_done():
                # Before any checkpoint (one without the lost member cannot be taken) and
                # any retire (the lost member would refuse it).
                stopped = await self._recover()
                if stopped is not None:
                    return stopped
                next_at = time.monotonic() + every if every else None
                continue
            if requests.checkpoint or (next_at is not None and now >= next_at):
                trigger = requests.checkpoint_trigger if requests.checkpoint else Trigger.PERIODIC
                requests.checkpoint = False
                await self._checkpoint(stop=False, trigger=trigger)
                next_at = time.monotonic() + every if every else None
                continue
            if now >= control.retry_at:
                if book.retire_queue:
                    await self.parts.retirement.retire_failed(self.fleet)
                    continue
                if book.unsent_restores:
                    await self.parts.retirement.retire_unsent_restores(self.fleet)
                    continue
                if book.forget_queue:
                    await self.parts.retirement.forget_retired(self.fleet)
                    continue
            if book.all_done() and not book.unsent_restores:
                break
            waits = [t for t in (next_at, control.retry_at) if t is not None and t > now]
            requests.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    requests.wake.wait(), timeout=min(waits) - now if waits else None
                )
        await self.parts.retirement.forget_at_the_end(self.fleet)
        self.counts.phase = "done"
        self.parts.view.note(finished_note(self.counts, self.options.output))
        return finished_code(self.counts)

    async def _checkpoint(self, *, stop: bool, trigger: str) -> str | None:
        """Pause dispatching, take and publish one checkpoint, reopen; None when none could
        be taken (the previous one stays the restore point). With `stop` the fleet stays
        closed afterwards and dispatching stays paused."""
        dispatcher = self.parts.dispatcher
        await dispatcher.pause()
        self.parts.steps.number += 1
        try:
            published = await self.parts.checkpoints.take(stop=stop, trigger=trigger)
        finally:
            if not stop and not self.parts.recovery.lost:
                dispatcher.reopen()
            self.counts.phase = "collecting" if not stop else "stopping"
            self.notify()
        if published is not None:
            self.counts.checkpoints += 1
            self.counts.last_checkpoint = published
            self.counts.last_checkpoint_at = time.time()
            self.parts.view.note(f"collect: checkpoint {published} published")
        return published

    async def _recover(self) -> int | None:
        """Recover the fleet in place (`member_loss.InPlaceRecovery`) and go on: None. The
        exit code when the run stopped instead (the bound of recoveries reached, or a member
        that stays down)."""
        dispatcher, recovery = self.parts.dispatcher, self.parts.recovery
        await dispatcher.pause()
        try:
            fleet = await recovery.recover(
                self.fleet, dispatcher.settle_in_flight, lambda: self.requests.stop
            )
        except GaveUp as error:
            return await self._give_up(str(error))
        if fleet is None:
            return None  # a stop was requested while waiting: the loop stops next
        if fleet is not self.fleet:
            old, self.fleet = self.fleet, fleet
            self.parts.checkpoints.fleet = fleet
            await old.close()
            if dispatcher.acknowledgements is not None:
                dispatcher.acknowledgements.owed()  # what the restore holds again, to `fleet`
            # Checkpoint at once: until a checkpoint names the restored attempts N+1, a
            # second loss could continue none of them (they were used since).
            self.requests.checkpoint = True
            self.requests.checkpoint_trigger = Trigger.SUPERVISOR
        if recovery.lost:
            return None  # lost again meanwhile: the loop recovers again before anything else
        self.counts.phase = "collecting"
        dispatcher.reopen()
        self.notify()
        await asyncio.sleep(0)  # the continued rollouts leave before that checkpoint closes
        return None

    async def _give_up(self, reason: str) -> int:
        """Stop without a checkpoint (a fleet that lost a member's state cannot take one;
        `LATEST` stays the restore point) and say how to resume."""
        self.counts.phase = "stopped: a member was lost"
        await self.parts.dispatcher.cancel_in_flight()
        self.stopped = True
        options = self.options
        self.parts.view.note(gave_up_note(self.counts, options.output, options.command, reason))
        return ExitCode.UNREACHABLE

    async def _stop(self) -> int:
        """Take a checkpoint, leave the fleet closed, and say how to resume."""
        self.counts.phase = "stopping: checkpoint"
        published = await self._checkpoint(stop=True, trigger=Trigger.SIGNAL)
        await self.parts.dispatcher.cancel_in_flight()
        self.stopped = True
        options = self.options
        self.parts.view.note(stopped_note(self.counts, options.output, options.command, published))
        return stopped_code(self.requests.stop_signal)
