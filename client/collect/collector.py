"""The collector: K rollouts of every task through a fleet, losing nothing to a crash.

It sends every (task, repeat) as a rollout `<task_id>.<repeat>` to the entry point
(`POST <entry-url>/ng-rollout/<capture_key>/run {"task": row}`), at most `concurrency` at a
time, and appends each reply to the output as one JSON line. The `Collector` sets a run up,
hands it to the control loop (`control_loop`: checkpoints, recoveries in place, retiring,
stopping) and takes it down. Every rule below exists for a crash (of the collector, a server,
or everything) at the step before it:

* **Nothing touches the fleet before the run's starting point is read** (`starting_point`):
  the output appendable, the store read within `--checkpoint-timeout`, a previous run's
  output, dispatch log and `LATEST` read on `--resume`, an old collection refused without it.
* **`resume`** sets the fleet up from what the previous run left (`resume.FleetSetup`) before
  anything is dispatched: `LATEST` restored into the fleet as it is found, survivors
  rejoining, so a crash of the collector alone costs no rollout its progress. Nothing is ever
  restored from an unpublished checkpoint (the library only restores published ones).
* **Output lines are durable before they count** (`journal.DurableAppender`): a checkpoint
  never names a rollout "finished" that a power loss can take out of the output again.
* **The dispatch log is written ahead** (`dispatch`): which attempt of which rollout was
  sent, durably, *before* the request leaves. After a crash the collector knows every attempt
  that may still run somewhere and retires it, and never sends an attempt number twice to a
  fleet that kept running. This run's header goes ahead of its first dispatch: `--resume`
  restores a checkpoint only when no later run dispatched after it.
* **A member seen lost closes the dispatch gate at once** (`member_loss`), on the loop,
  before the control loop gets to recover it: an attempt sent now would run against a member
  that lost its state.
* **The requests in flight are cancelled before their HTTP client closes**, and whatever the
  run raises, the output and the dispatch log are closed holding only whole, durable lines.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from datetime import UTC, datetime

import httpx
from rich.console import Console

from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.collect.checkpoints import (
    CheckpointSettings,
    CheckpointStepHook,
    CheckpointTaker,
    NumberedSteps,
)
from rollout_checkpoint.client.collect.control import ControlCalls
from rollout_checkpoint.client.collect.control_loop import ControlLoop, RunningParts, RunRequests
from rollout_checkpoint.client.collect.dispatch import Dispatcher
from rollout_checkpoint.client.collect.ending import finished_code
from rollout_checkpoint.client.collect.groups import GroupWriter
from rollout_checkpoint.client.collect.journal import DurableAppender, json_line
from rollout_checkpoint.client.collect.member_loss import InPlaceRecovery
from rollout_checkpoint.client.collect.options import CollectOptions
from rollout_checkpoint.client.collect.receipts import (
    ACK_SETTLE_SECONDS,
    Acknowledgements,
    HeldResults,
    check_outbox_room,
)
from rollout_checkpoint.client.collect.resume import FleetSetup
from rollout_checkpoint.client.collect.retirement import Retirement
from rollout_checkpoint.client.collect.rollouts import Rollout, RolloutBook, now_text
from rollout_checkpoint.client.collect.staleness import RecordDropped, StaleHandling
from rollout_checkpoint.client.collect.starting_point import StartingPoint, read_starting_point
from rollout_checkpoint.client.collect.view import CollectView, Counts
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, load_fleet_file
from rollout_checkpoint.server.core.keep_alive import client_limits


class Collector:
    """One run of a collection (see the module doc); `run` it once.

    `step_hook` (fault tests and certify only) is called at each step of each checkpoint
    and of each in-place recovery, see `CheckpointStepHook`."""

    def __init__(
        self,
        options: CollectOptions,
        console: Console,
        *,
        step_hook: CheckpointStepHook | None = None,
    ) -> None:
        self.options = options
        self.console = console
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        self.run_id = f"run-{stamp}-{secrets.token_hex(4)}"
        self.counts = Counts()
        self.book: RolloutBook | None = None
        self.view = CollectView(
            console, self.counts, lambda: self.book.in_flight if self.book else 0
        )
        self.control = ControlCalls(self.run_id, self.view)
        self.requests = RunRequests()
        self.stopped = False
        """The run stopped before every rollout was collected (a signal, a lost member)."""
        self._steps = NumberedSteps(step_hook)
        self._step_hook = step_hook
        self.fleet: Fleet | None = None
        self.dispatcher: Dispatcher | None = None
        self.recovery: InPlaceRecovery | None = None
        self._control_loop: ControlLoop | None = None

    async def run(self) -> int:
        """Collect everything; the exit code (`ExitCode.OK`, `FAILURES_RECORDED`, and
        `INTERRUPTED`/`TERMINATED` after a stop by SIGINT/SIGTERM).

        An `--output` that cannot be appended to raises `OutputFailed` first, before the fleet
        is touched. Raises `UsageError` (bad input, or a collection state that does not fit the options),
        `CorruptFile`, `OutputFailed`, `FleetConfigError`, `DiscoveryError`, `FleetError`,
        `ControlError` or `PublicationError`; `cli.run_collect` maps each to its exit code.
        Whatever it raises, the output and the dispatch log hold only whole, durable lines."""
        options = self.options
        start = await read_starting_point(options, self.counts, self.view, self._steps)
        book = self.book = start.book
        if book.settled():
            self.view.note(f"collect: every rollout is already in {options.output}; nothing to do")
            return finished_code(self.counts)
        spec = load_fleet_file(options.fleet)
        self.fleet = await Fleet.discover(spec)
        try:  # a recovery swaps the fleet for one discovered again: close whichever is current
            await check_outbox_room(self.fleet, options.concurrency, options.num_repeats)
            settings = CheckpointSettings(
                run_id=self.run_id,
                input_digest=start.input_digest,
                num_repeats=options.num_repeats,
                timeout=options.checkpoint_timeout,
                straggler_rounds=options.straggler_rounds,
                keep=options.keep or spec.keep,
            )
            loop = asyncio.get_running_loop()
            handled = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
            loop.add_signal_handler(signal.SIGUSR1, self.request_checkpoint)
            loop.add_signal_handler(signal.SIGTERM, self.request_stop, signal.SIGTERM)
            loop.add_signal_handler(signal.SIGINT, self.request_stop, signal.SIGINT)
            try:
                with self.view:
                    return await self._collect(start, settings, spec)
            finally:
                for signum in handled:
                    loop.remove_signal_handler(signum)
        finally:
            if self.fleet is not None:
                await self.fleet.close()

    def request_checkpoint(self) -> None:
        """Take a checkpoint as soon as possible and continue (SIGUSR1)."""
        self.requests.checkpoint = True
        self.requests.checkpoint_trigger = Trigger.SIGNAL
        self._notify()

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Take a checkpoint and stop, leaving the fleet closed (SIGTERM, SIGINT: `signum`
        chooses the exit code, 143 or 130)."""
        self.requests.stop = True
        self.requests.stop_signal = signal.Signals(signum)
        self._notify()

    async def _collect(
        self, start: StartingPoint, settings: CheckpointSettings, spec: FleetSpec
    ) -> int:
        output = DurableAppender(self.options.output)
        dispatch_log = DurableAppender(start.log_path)
        await output.open()
        await dispatch_log.open()
        try:
            return await self._collect_into(start, settings, spec, output, dispatch_log)
        finally:
            await output.close()
            await dispatch_log.close()

    async def _collect_into(
        self,
        start: StartingPoint,
        settings: CheckpointSettings,
        spec: FleetSpec,
        output: DurableAppender,
        dispatch_log: DurableAppender,
    ) -> int:
        options, fleet, book = self.options, self.fleet, start.book
        assert fleet is not None
        self.counts.phase = "setting up the fleet"
        # Before the fleet is set up: a dropped line the setup writes may seal a group whose
        # receipts are then acknowledged like any other.
        acknowledgements = Acknowledgements(self._current_fleet, book.ledger, self._step_hook)
        stale = StaleHandling(
            options.staleness, book, self.view, self._dropped_into(book, output, acknowledgements)
        )
        setup = FleetSetup(fleet, start.root, book, self.view, self.control, stale)
        held = HeldResults(fleet, book, output, self.view, acknowledgements)
        await setup.run(
            start.previous,
            time.time() + options.checkpoint_timeout,
            held.take_back if options.resume else held.release,
        )
        limits = client_limits(
            max_connections=options.concurrency + 8,
            max_keepalive_connections=options.concurrency,
        )
        timeout = httpx.Timeout(options.request_timeout, connect=30.0)
        acknowledging = asyncio.create_task(acknowledgements.run())
        try:
            header = {
                "run_id": self.run_id,
                "started_at": now_text(),
                "boot_ids": {m.name: m.boot_id for m in fleet.members},
            }
            await dispatch_log.append(json_line(header))
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
                dispatcher = self.dispatcher = Dispatcher(
                    book,
                    output,
                    dispatch_log,
                    http,
                    entry_url=options.entry_url,
                    concurrency=options.concurrency,
                    on_change=self._notify,
                    on_fatal=self._fail,
                    acknowledgements=acknowledgements,
                    step_hook=self._step_hook,
                )
                recovery = self.recovery = InPlaceRecovery(
                    spec,
                    start.root,
                    book,
                    self.view,
                    self.control,
                    run_id=self.run_id,
                    max_recoveries=options.max_recoveries,
                    timeout=options.checkpoint_timeout,
                    on_loss=self._member_lost,
                    step_hook=self._step_hook,
                    stale=stale,
                )
                parts = RunningParts(
                    book,
                    self.view,
                    self.control,
                    dispatcher,
                    recovery,
                    CheckpointTaker(
                        fleet,
                        start.root,
                        book,
                        output,
                        self.view,
                        self.control,
                        settings,
                        self._steps,
                        self._resumed_early,
                        ledger_state=acknowledgements.ledger_state,
                    ),
                    Retirement(
                        book,
                        output,
                        self.view,
                        self.control,
                        max_attempts=options.max_attempts,
                        timeout=options.checkpoint_timeout,
                        on_change=self._notify,
                        on_fatal=self._fail,
                        acknowledgements=acknowledgements,
                    ),
                    self._steps,
                )
                control_loop = self._control_loop = ControlLoop(
                    options, fleet, parts, self.requests, self._notify
                )
                recovery.start(fleet)
                dispatching = asyncio.create_task(dispatcher.run())
                self.counts.phase = "collecting"
                try:
                    return await control_loop.run()
                finally:
                    self.fleet, self.stopped = control_loop.fleet, control_loop.stopped
                    dispatching.cancel()
                    await asyncio.gather(dispatching, return_exceptions=True)
                    await dispatcher.cancel_in_flight()  # before their client closes under them
                    await recovery.close()
        finally:
            # What is durable is acknowledged while the fleet is still open; what is not
            # acknowledged now stays held, and the next run acknowledges it.
            acknowledging.cancel()
            await asyncio.gather(acknowledging, return_exceptions=True)
            await acknowledgements.settle(ACK_SETTLE_SECONDS)

    @staticmethod
    def _dropped_into(
        book: RolloutBook, output: DurableAppender, acknowledgements: Acknowledgements
    ) -> RecordDropped:
        """A dropped line settles its rollout like a failure: it waits for its group."""

        async def record(rollout: Rollout, reason: str) -> None:
            if await GroupWriter(book, output).hold(rollout, rollout.dropped_line(reason)):
                acknowledgements.owed()

        return record

    def _current_fleet(self) -> Fleet | None:
        """The fleet now: a recovery in place swaps it for one discovered again."""
        if self._control_loop is not None:
            return self._control_loop.fleet
        return self.fleet

    # -- what the parts report ------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake the control loop and every part waiting for a change."""
        self.requests.wake.set()
        if self.dispatcher is not None:
            self.dispatcher.wake()
        if self.recovery is not None:
            self.recovery.wake()

    def _member_lost(self) -> None:
        """A member was first seen lost: nothing new leaves until the fleet is recovered, and
        the failures it may have caused stop counting (`RolloutBook.member_lost`)."""
        assert self.book is not None
        self.book.member_lost()
        if self.dispatcher is not None:
            self.dispatcher.close_gate()
        self._notify()

    def _fail(self, error: BaseException) -> None:
        self.requests.fatal = error
        self._notify()

    def _resumed_early(self) -> None:
        """An asynchronous checkpoint resumed the fleet before its parts are durable: dispatch
        again now (unless a member was lost), not once it is published."""
        if self.dispatcher is not None and not (self.recovery is not None and self.recovery.lost):
            self.dispatcher.reopen()
