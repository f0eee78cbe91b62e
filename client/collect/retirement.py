"""Failed rollouts retired before they are retried, and retired rollouts forgotten.

A failed attempt is retired on every member (`retire`), in batches, before the rollout is
sent again as attempt N+1: a retried attempt that was not retired could leave the failed
attempt's half-built state running next to it. Retiring happens between checkpoints (it is
refused while one is open; the collector's control loop never runs both at once). Up to
`max_attempts` failures are retried; after that the rollout is recorded in the output as
failed (its line waits for its prompt group, `groups`, like a result). The retire marks are
forgotten (`forget`) once a later attempt replied, and at the end of the run for rollouts
recorded as failed: from then on nothing of the retired attempts can still run, and the
marks would only grow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.collect.control import BATCH, ControlCalls
from rollout_checkpoint.client.collect.errors import OutputFailed
from rollout_checkpoint.client.collect.groups import GroupWriter
from rollout_checkpoint.client.collect.journal import DurableAppender
from rollout_checkpoint.client.collect.receipts import Acknowledgements
from rollout_checkpoint.client.collect.rollouts import RolloutBook
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Retirement:
    """Retires and forgets the rollouts of one collection, a batch a call (see the module
    doc). Each call takes the fleet as it is now (a recovery in place swaps it).

    `on_change` is called once retried rollouts may be dispatched again; `on_fatal` with an
    error the run cannot go on after (a failed rollout that cannot be retired, an output
    that cannot be written)."""

    book: RolloutBook
    output: DurableAppender
    view: CollectView
    control: ControlCalls
    _: KW_ONLY
    max_attempts: int
    timeout: float
    """Seconds for one retire or forget call on the whole fleet."""
    on_change: Callable[[], None]
    on_fatal: Callable[[BaseException], None]
    acknowledgements: Acknowledgements | None = None
    """Where the receipts of a group a failed line sealed go once its write is durable."""

    async def retire_failed(self, fleet: Fleet) -> None:
        """Retire a batch of failed attempts, then send each again as a later attempt, or
        record it failed once it used up its attempts."""
        book = self.book
        batch = book.retire_queue[:BATCH]
        deadline = time.time() + self.timeout
        try:
            await fanout.retire(
                fleet, self.control.new_id("retire"), deadline, [r.episode for r in batch]
            )
        except (FleetError, ControlError) as error:
            if self.control.failed(f"retire of {len(batch)} failed rollout(s)", error):
                self.on_fatal(error)  # without retiring, no failed rollout may run again
            return
        self.control.succeeded()
        del book.retire_queue[: len(batch)]
        for rollout in batch:
            book.retired(rollout, rollout.attempt)
            if book.exhausted(rollout, self.max_attempts):
                try:
                    written = await GroupWriter(book, self.output).hold(
                        rollout, rollout.failed_line()
                    )
                except OutputFailed as error:
                    self.on_fatal(error)
                    return
                if written and self.acknowledgements is not None:
                    self.acknowledgements.owed()
                self.view.note(
                    f"collect: {rollout.rollout_id} failed {rollout.failures} time(s), "
                    f"recorded as failed: {rollout.last_error}"
                )
            else:
                book.retry(rollout)
        self.on_change()

    async def retire_unsent_restores(self, fleet: Fleet) -> None:
        """Retire a batch of restored N+1 attempts that will never be sent (their rollouts
        are written: `RolloutBook.unsent_restores`), so no member keeps them as live
        sessions; the rollouts are forgotten next, like every retired one that is done."""
        book = self.book
        batch = book.unsent_restores[:BATCH]
        deadline = time.time() + self.timeout
        try:
            await fanout.retire(fleet, self.control.new_id("retire"), deadline, batch)
        except (FleetError, ControlError) as error:
            if self.control.failed(f"retire of {len(batch)} unsent restored attempt(s)", error):
                # Their rollouts are written: a member that keeps them costs memory, not
                # correctness, and the next checkpoint's Commit frees what is out of scope.
                log.warning("collect: giving up retiring %s", [e.capture_key for e in batch])
                del book.unsent_restores[: len(batch)]
                self.control.succeeded()
            return
        self.control.succeeded()
        del book.unsent_restores[: len(batch)]
        for episode in batch:
            book.retired(book.rollouts[episode.rollout_id], episode.attempt)

    async def forget_retired(self, fleet: Fleet) -> None:
        """Forget a batch of retired rollouts a later attempt of which replied."""
        book = self.book
        batch = sorted(book.forget_queue)[:BATCH]
        deadline = time.time() + self.timeout
        try:
            await fanout.forget(fleet, self.control.new_id("forget"), deadline, batch)
        except (FleetError, ControlError) as error:
            if self.control.failed(f"forget of {len(batch)} rollout(s)", error):
                # Forgetting is housekeeping (the marks only refuse stale attempts): give up
                # on these, not on the run.
                book.forget_queue.difference_update(batch)
                self.control.succeeded()
            return
        self.control.succeeded()
        book.forgotten(batch)

    async def forget_at_the_end(self, fleet: Fleet) -> None:
        """Rollouts recorded as failed keep their marks until nothing runs any more."""
        left = self.book.still_marked()
        deadline = time.time() + self.timeout
        for start in range(0, len(left), BATCH):
            try:
                await fanout.forget(
                    fleet, self.control.new_id("forget"), deadline, left[start : start + BATCH]
                )
            except (FleetError, ControlError) as exc:
                # Safe to go on: the marks only refuse late requests of rollouts that will
                # never run again; a member that keeps them costs memory, not correctness.
                log.warning("collect: forgetting finished rollouts failed (%s); going on", exc)
