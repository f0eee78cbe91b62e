"""The collector: K rollouts of every task through a fleet, losing nothing to a crash.

It sends every (task, repeat) as a rollout `<task_id>.<repeat>` to the entry point
(`POST <entry-url>/ng-rollout/<capture_key>/run {"task": row}`), at most `concurrency` at a
time, and appends each reply to the output as one JSON line. Every rule below exists for a
crash (of the collector, a server, or everything) at the step before it:

* **Output lines are durable before they count** (`journal.DurableAppender`): a checkpoint
  never names a rollout "finished" that a power loss can take out of the output again.
* **The dispatch log is written ahead** (`dispatch`): which attempt of which rollout was
  sent, durably, *before* the request leaves. After a crash the collector knows every attempt
  that may still run somewhere and retires it, and never sends an attempt number twice to a
  fleet that kept running.
* **Checkpoints are the library's, with the collector's state inside** (`checkpoints`), every
  `checkpoint_every` seconds, on SIGUSR1 (and continue) and on SIGTERM/SIGINT (and stop, the
  fleet left closed); dispatching pauses while one runs.
* **Failed rollouts are retired before they are retried**, between checkpoints (retire is
  refused while one is open), in batches, then sent again as attempt N+1 — up to
  `max_attempts` failures, after which the rollout is recorded in the output as failed. A
  retried attempt that was not retired could leave the failed attempt's half-built state
  running next to it.
* **A member lost mid-run is recovered in place** (`recovery.InPlaceRecovery`): dispatching
  stops, this run's latest checkpoint is restored into the whole fleet (the survivors
  rejoin), and the rollouts it cut continue or restart, at most `max_recoveries` times. The
  alternative, exiting for a `--resume`, would stop a whole evaluation for one pod restart.
  Past that bound the run stops as on SIGTERM (without a checkpoint: a fleet that lost a
  member's state cannot take one) and says how to resume.
* **`resume`** reads the output, the dispatch log and `LATEST` (`journal.read_previous`) and
  sets the fleet up from them (`resume.FleetSetup`): `LATEST` restored into the fleet as it
  is found, survivors rejoining, so a crash of the collector alone costs no rollout its
  progress. Nothing is ever restored from an unpublished checkpoint (the library only
  restores published ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationRoot,
    open_checkpoint_root,
    store_call,
)
from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.collect.checkpoints import (
    CheckpointSettings,
    CheckpointStepHook,
    CheckpointTaker,
)
from rollout_checkpoint.client.collect.control import BATCH, ControlCalls
from rollout_checkpoint.client.collect.dispatch import Dispatcher
from rollout_checkpoint.client.collect.errors import OutputFailed, UsageError
from rollout_checkpoint.client.collect.inputs import load_input
from rollout_checkpoint.client.collect.journal import (
    DurableAppender,
    Previous,
    check_appendable,
    dispatch_log_path,
    json_line,
    read_previous,
)
from rollout_checkpoint.client.collect.recovery import GaveUp, InPlaceRecovery
from rollout_checkpoint.client.collect.resume import FleetSetup
from rollout_checkpoint.client.collect.rollouts import RolloutBook, now_text
from rollout_checkpoint.client.collect.view import CollectView, Counts
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, load_fleet_file

log = logging.getLogger(__name__)


@dataclass
class CollectOptions:
    """One collection's settings (the CLI's flags of the same names)."""

    fleet: Path
    """The fleet file (TOML or YAML)."""
    entry_url: str
    """The entry point's base URL (the environment server's or the agent's HTTP address)."""
    input: Path
    """The tasks, one JSON object a line."""
    output: Path
    """The rollouts, one JSON line each."""
    checkpoint_dir: Path | str
    """A directory, or an object-store URL (`s3://bucket/prefix`)."""
    num_repeats: int = 1
    """Rollouts per task (K)."""
    concurrency: int = 32
    """Rollouts in flight at once."""
    checkpoint_every: float | None = None
    """Seconds between checkpoints (None: only on SIGUSR1 and when the run stops)."""
    resume: bool = False
    """Continue the collection in `output` and `checkpoint_dir`."""
    max_attempts: int = 3
    """Failures of one rollout before it is recorded as failed."""
    max_recoveries: int = 3
    """Recoveries in place after a lost member (0: none; the run stops for a `--resume`)."""
    checkpoint_timeout: float = 300.0
    """Seconds for one checkpoint, and for one recovery including the wait for a lost member to
    answer again."""
    request_timeout: float = 3600.0
    """Seconds for one `/run`."""
    keep: int | None = None
    """Published checkpoints kept (None: the fleet file's `keep`)."""
    straggler_rounds: int = 1
    """Retries of a checkpoint whose prepare was not done in time, each after retiring the
    rollouts still blocking it; then that checkpoint is given up."""
    command: Sequence[str] = ()
    """The command line that started the run, repeated with `--resume` when it stops."""


class Collector:
    """One run of a collection (see the module doc); `run` it once.

    `step_hook` (fault tests only) is called at each step of each checkpoint, see
    `CheckpointStepHook`."""

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
        self.stop_requested = False
        self.stop_signal = signal.SIGTERM
        self.stopped = False
        """The run stopped before every rollout was collected (a signal, a lost member)."""
        self.checkpoint_requested = False
        self.fatal: BaseException | None = None
        self._step_hook = step_hook
        self._control_wake = asyncio.Event()
        self._checkpoint_number = 0
        self.fleet: Fleet | None = None
        self.checkpoints: CheckpointTaker | None = None
        self.output: DurableAppender | None = None
        self.dispatch_log: DurableAppender | None = None
        self.dispatcher: Dispatcher | None = None
        self.recovery: InPlaceRecovery | None = None

    # -- entry ----------------------------------------------------------------------------------

    async def run(self) -> int:
        """Collect everything; the exit code (`ExitCode.OK`, `FAILURES_RECORDED`, and
        `INTERRUPTED`/`TERMINATED` after a stop by SIGINT/SIGTERM).

        An `--output` that cannot be appended to raises `OutputFailed` first, before the fleet
        is touched. Raises `UsageError` (bad input, or a collection state that does not fit the options),
        `CorruptFile`, `OutputFailed`, `FleetConfigError`, `DiscoveryError`, `FleetError`,
        `ControlError` or `PublicationError`; `cli.run_collect` maps each to its exit code.
        Whatever it raises, the output and the dispatch log hold only whole, durable lines."""
        options = self.options
        await asyncio.to_thread(check_appendable, options.output)
        tasks, input_digest = await asyncio.to_thread(
            load_input, options.input, options.num_repeats
        )
        book = self.book = RolloutBook(tasks, options.num_repeats, self.counts)
        # The checkpoint store is read before anything else touches the fleet, bounded as a
        # checkpoint is: a store that hangs is StorageFailed at that deadline, not a wait on
        # the store client's own timeout or a frozen filesystem's thaw.
        deadline = time.time() + options.checkpoint_timeout
        location = os.fspath(options.checkpoint_dir)
        root = await store_call(
            deadline, location, open_checkpoint_root, options.checkpoint_dir, crash_hook=self._step
        )
        log_path = dispatch_log_path(options.checkpoint_dir, options.output)
        if options.resume:
            previous = await store_call(
                deadline, location, read_previous, options.output, log_path, root, input_digest
            )
        else:
            await store_call(deadline, location, self._refuse_existing, root, log_path)
            previous = Previous()
        book.apply_output(previous.finished)
        if previous.output_cut:
            self.view.note(
                f"collect: cut a torn last line ({previous.output_cut} bytes) off {options.output}"
            )
        if previous.log_cut:
            self.view.note(
                f"collect: cut a torn last line ({previous.log_cut} bytes) off {log_path}"
            )
        if book.settled():
            self.view.note(f"collect: every rollout is already in {options.output}; nothing to do")
            return self._exit_code()
        spec = load_fleet_file(options.fleet)
        self.fleet = await Fleet.discover(spec)
        try:  # a recovery swaps the fleet for one discovered again: close whichever is current
            settings = CheckpointSettings(
                run_id=self.run_id,
                input_digest=input_digest,
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
                    return await self._collect(previous, root, log_path, settings, spec)
            finally:
                for signum in handled:
                    loop.remove_signal_handler(signum)
        finally:
            if self.fleet is not None:
                await self.fleet.close()

    def request_checkpoint(self) -> None:
        """Take a checkpoint as soon as possible and continue (SIGUSR1)."""
        self.checkpoint_requested = True
        self._notify()

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Take a checkpoint and stop, leaving the fleet closed (SIGTERM, SIGINT: `signum`
        chooses the exit code, 143 or 130)."""
        self.stop_requested = True
        self.stop_signal = signal.Signals(signum)
        self._notify()

    async def _collect(
        self,
        previous: Previous,
        root: PublicationRoot,
        log_path: Path,
        settings: CheckpointSettings,
        spec: FleetSpec,
    ) -> int:
        options, fleet, book = self.options, self.fleet, self.book
        assert fleet is not None and book is not None
        self.counts.phase = "setting up the fleet"
        setup = FleetSetup(fleet, root, book, self.view, self.control)
        await setup.run(previous, time.time() + options.checkpoint_timeout)
        self.output = DurableAppender(options.output)
        self.dispatch_log = DurableAppender(log_path)
        await self.output.open()
        await self.dispatch_log.open()
        self.checkpoints = CheckpointTaker(
            fleet,
            root,
            book,
            self.output,
            self.view,
            self.control,
            settings,
            self._step,
            self._resumed_early,
        )
        limits = httpx.Limits(
            max_connections=options.concurrency + 8,
            max_keepalive_connections=options.concurrency,
        )
        timeout = httpx.Timeout(options.request_timeout, connect=30.0)
        try:
            # The run header goes ahead of this run's first dispatch: `--resume` restores a
            # checkpoint only when no later run dispatched after it.
            header = {
                "run_id": self.run_id,
                "started_at": now_text(),
                "boot_ids": {m.name: m.boot_id for m in fleet.members},
            }
            await self.dispatch_log.append(json_line(header))
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
                self.dispatcher = Dispatcher(
                    book,
                    self.output,
                    self.dispatch_log,
                    http,
                    entry_url=options.entry_url,
                    concurrency=options.concurrency,
                    on_change=self._notify,
                    on_fatal=self._fail,
                )
                self.recovery = InPlaceRecovery(
                    spec,
                    root,
                    book,
                    self.view,
                    self.control,
                    run_id=self.run_id,
                    max_recoveries=options.max_recoveries,
                    timeout=options.checkpoint_timeout,
                    on_loss=self._member_lost,
                )
                self.recovery.start(fleet)
                dispatcher = asyncio.create_task(self.dispatcher.run())
                self.counts.phase = "collecting"
                try:
                    return await self._control_loop()
                finally:
                    dispatcher.cancel()
                    await asyncio.gather(dispatcher, return_exceptions=True)
                    await self._cancel_in_flight()  # before their client closes under them
                    await self.recovery.close()
        finally:
            await self.output.close()
            await self.dispatch_log.close()

    def _refuse_existing(self, root: PublicationRoot, log_path: Path) -> None:
        """A fresh run next to an old one would mix two collections' attempts and lines."""
        output = self.options.output
        if output.exists() and output.stat().st_size > 0:
            raise UsageError(f"{output} already holds rollouts: pass --resume to continue them")
        if log_path.exists() or root.published():
            raise UsageError(
                f"{root.location} already holds a collection: pass --resume to continue it"
            )

    # -- dispatching ----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._control_wake.set()
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
        self.fatal = error
        self._notify()

    async def _cancel_in_flight(self) -> None:
        if self.dispatcher is not None:
            await self.dispatcher.cancel_in_flight()

    # -- control --------------------------------------------------------------------------------

    async def _control_loop(self) -> int:
        book = self.book
        assert book is not None
        every = self.options.checkpoint_every
        next_at = time.monotonic() + every if every else None
        while True:
            if self.fatal is not None:
                raise self.fatal
            now = time.monotonic()
            if self.stop_requested:
                return await self._stop()
            if self.recovery is not None and self.recovery.lost and not book.all_done():
                # Before any checkpoint (one without the lost member cannot be taken) and
                # any retire (the lost member would refuse it).
                stopped = await self._recover()
                if stopped is not None:
                    return stopped
                next_at = time.monotonic() + every if every else None
                continue
            if self.checkpoint_requested or (next_at is not None and now >= next_at):
                self.checkpoint_requested = False
                await self._checkpoint(stop=False)
                next_at = time.monotonic() + every if every else None
                continue
            if now >= self.control.retry_at:
                if book.retire_queue:
                    await self._retire_failed()
                    continue
                if book.forget_queue:
                    await self._forget_retired()
                    continue
            if book.all_done():
                break
            waits = [t for t in (next_at, self.control.retry_at) if t is not None and t > now]
            self._control_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._control_wake.wait(), timeout=min(waits) - now if waits else None
                )
        await self._forget_at_the_end()
        self.counts.phase = "done"
        self.view.note(
            f"collect: {self.counts.done} rollout(s) collected, {self.counts.failed} failed, "
            f"into {self.options.output}; {self.counts.checkpoints} checkpoint(s) taken"
        )
        return self._exit_code()

    def _exit_code(self) -> int:
        return ExitCode.FAILURES_RECORDED if self.counts.failed else ExitCode.OK

    async def _retire_failed(self) -> None:
        """Retire failed attempts (between checkpoints: refused while one is open), then send
        each again as a later attempt, or record it failed once it used up its attempts."""
        fleet, output, book = self.fleet, self.output, self.book
        assert fleet is not None and output is not None and book is not None
        batch = book.retire_queue[:BATCH]
        deadline = time.time() + self.options.checkpoint_timeout
        try:
            await fanout.retire(
                fleet, self.control.new_id("retire"), deadline, [r.episode for r in batch]
            )
        except (FleetError, ControlError) as error:
            if self.control.failed(f"retire of {len(batch)} failed rollout(s)", error):
                self.fatal = error  # without retiring, no failed rollout may run again
            return
        self.control.succeeded()
        del book.retire_queue[: len(batch)]
        for rollout in batch:
            book.retired(rollout, rollout.attempt)
            if book.exhausted(rollout, self.options.max_attempts):
                try:
                    await output.append(json_line(rollout.failed_line()))
                except OutputFailed as error:
                    self.fatal = error
                    return
                book.recorded_failed(rollout)
                self.view.note(
                    f"collect: {rollout.rollout_id} failed {rollout.failures} time(s), "
                    f"recorded as failed: {rollout.last_error}"
                )
            else:
                book.retry(rollout)
        self._notify()

    async def _forget_retired(self) -> None:
        """A retired rollout is forgotten once a later attempt replied: from then on nothing of
        the retired attempts can still run, and the marks would only grow."""
        fleet, book = self.fleet, self.book
        assert fleet is not None and book is not None
        batch = sorted(book.forget_queue)[:BATCH]
        deadline = time.time() + self.options.checkpoint_timeout
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

    async def _forget_at_the_end(self) -> None:
        """Rollouts recorded as failed keep their marks until nothing runs any more."""
        fleet, book = self.fleet, self.book
        assert fleet is not None and book is not None
        left = book.still_marked()
        deadline = time.time() + self.options.checkpoint_timeout
        for start in range(0, len(left), BATCH):
            try:
                await fanout.forget(
                    fleet, self.control.new_id("forget"), deadline, left[start : start + BATCH]
                )
            except (FleetError, ControlError) as exc:
                # Safe to go on: the marks only refuse late requests of rollouts that will
                # never run again; a member that keeps them costs memory, not correctness.
                log.warning("collect: forgetting finished rollouts failed (%s); going on", exc)

    # -- checkpoints ----------------------------------------------------------------------------

    async def _checkpoint(self, *, stop: bool) -> str | None:
        """Pause dispatching, take and publish one checkpoint, reopen; None when none could
        be taken (the previous one stays the restore point). With `stop` the fleet stays
        closed afterwards and dispatching stays paused."""
        assert self.checkpoints is not None and self.dispatcher is not None
        await self.dispatcher.pause()
        self._checkpoint_number += 1
        try:
            published = await self.checkpoints.take(stop=stop)
        finally:
            if not stop and not (self.recovery is not None and self.recovery.lost):
                self.dispatcher.reopen()
            self.counts.phase = "collecting" if not stop else "stopping"
            self._notify()
        if published is not None:
            self.counts.checkpoints += 1
            self.counts.last_checkpoint = published
            self.counts.last_checkpoint_at = time.time()
            self.view.note(f"collect: checkpoint {published} published")
        return published

    def _resumed_early(self) -> None:
        """An asynchronous checkpoint resumed the fleet before its parts are durable: dispatch
        again now (unless a member was lost), not once it is published."""
        if self.dispatcher is not None and not (self.recovery is not None and self.recovery.lost):
            self.dispatcher.reopen()

    def _step(self, name: str) -> None:
        """A step of the current checkpoint: the fault tests' hook, if any, sees it."""
        if self._step_hook is not None:
            self._step_hook(name, self._checkpoint_number)

    # -- a lost member ------------------------------------------------------------------------

    async def _recover(self) -> int | None:
        """Recover the fleet in place (`recovery.InPlaceRecovery`) and go on: None. The exit
        code when the run stopped instead (the bound of recoveries reached, or a member
        that stays down)."""
        assert self.recovery is not None and self.dispatcher is not None
        assert self.checkpoints is not None and self.fleet is not None
        await self.dispatcher.pause()
        try:
            fleet = await self.recovery.recover(
                self.fleet, self.dispatcher.settle_in_flight, lambda: self.stop_requested
            )
        except GaveUp as error:
            return await self._give_up(str(error))
        if fleet is None:
            return None  # a stop was requested while waiting: the loop stops next
        if fleet is not self.fleet:
            old, self.fleet = self.fleet, fleet
            self.checkpoints.fleet = fleet
            await old.close()
            # Checkpoint at once: until a checkpoint names the restored attempts N+1, a
            # second loss could continue none of them (they were used since).
            self.checkpoint_requested = True
        if self.recovery.lost:
            return None  # lost again meanwhile: the loop recovers again before anything else
        self.counts.phase = "collecting"
        self.dispatcher.reopen()
        self._notify()
        await asyncio.sleep(0)  # the continued rollouts leave before that checkpoint closes
        return None

    async def _give_up(self, reason: str) -> int:
        """Stop without a checkpoint (a fleet that lost a member's state cannot take one;
        `LATEST` stays the restore point) and say how to resume."""
        self.counts.phase = "stopped: a member was lost"
        await self._cancel_in_flight()
        self.stopped = True
        done = self.counts.done + self.counts.failed
        self.view.note(
            f"collect: {reason}; stopped WITHOUT a new checkpoint ({done}/{self.counts.total} "
            f"rollouts in {self.options.output}). Once the fleet is whole again, continue from "
            f"the last one: {self._resume_command()}"
        )
        return ExitCode.UNREACHABLE

    def _resume_command(self) -> str:
        command = list(self.options.command) or ["rollout-checkpoint", "collect", "..."]
        if "--resume" not in command:
            command.append("--resume")
        return " ".join(shlex.quote(part) for part in command)

    async def _stop(self) -> int:
        self.counts.phase = "stopping: checkpoint"
        published = await self._checkpoint(stop=True)
        await self._cancel_in_flight()
        self.stopped = True
        again = self._resume_command()
        done = self.counts.done + self.counts.failed
        if published is not None:
            self.view.note(
                f"collect: stopped after checkpoint {published} ({done}/{self.counts.total} "
                f"rollouts in {self.options.output}). To continue: {again}"
            )
        else:
            self.view.note(
                f"collect: stopped WITHOUT a new checkpoint ({done}/{self.counts.total} rollouts "
                f"in {self.options.output}). To continue from the last one: {again}"
            )
        return ExitCode.INTERRUPTED if self.stop_signal == signal.SIGINT else ExitCode.TERMINATED
