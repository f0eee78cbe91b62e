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
* **The coordinator keeps no state.** On start it reads the members: any member started
  closed (a replacement that came up while no supervisor ran, or a fresh install) triggers
  a recovery at once; a fresh install has no `LATEST`, so its members are only opened.
* **A restart strategy bounds the tries**: at most `max_tries` recovery tries within
  `window_seconds`, with a doubling backoff between them. A try that fails leaves the members
  as they are (a retry replays where it succeeded); when the limit is reached the last try is
  undone all or nothing (every member it left RESTORED has the attempts N+1 retired and is
  resumed; members started closed stay closed, so no empty member joins the fleet), the
  supervisor stops acting, and `recovery_given_up` says why. A coordinator restarted by hand
  starts with a fresh strategy.
* **Another supervisor cannot corrupt anything**: a recovery's id is derived from the
  checkpoint and the boot ids (`recovery.recovery_id`), so two supervisors send the same calls
  and the members replay them, and a recovery that lost a race undoes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rollout_checkpoint.client.checkpointing import CheckpointOutcome, checkpoint
from rollout_checkpoint.client.coordination import DERIVE, FleetError, awaiting_restore
from rollout_checkpoint.client.coordinator.calls import (
    listed_blockers,
    prepare_outcome,
    status_of,
)
from rollout_checkpoint.client.coordinator.fleet_events import FleetEventLog
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, Fleet, FleetSpec
from rollout_checkpoint.client.membership import Change, FleetWatch, MemberEvent
from rollout_checkpoint.client.publication import (
    PublicationError,
    as_checkpoint_error,
    open_checkpoint_root,
    store_call,
)
from rollout_checkpoint.client.recovery import (
    Recovery,
    RecoveryLostRace,
    recover,
    recovery_id,
    undo_unfinished_recovery,
)
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.rpc.wire import duration, episode_message
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartStrategy:
    """How often the supervisor tries to recover before it gives up."""

    max_tries: int = 3
    """Recovery tries allowed within `window_seconds`; one more gives up."""
    window_seconds: float = 600.0
    backoff_seconds: float = 1.0
    """The wait after the first failed try; doubled after each further one."""
    max_backoff_seconds: float = 30.0


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


class GaveUp(Exception):
    """The restart strategy's limit was reached."""


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
        self._tries: deque[float] = deque()
        self._next_checkpoint = time.monotonic() + (settings.checkpoint_every or 0.0)
        self.watch = FleetWatch(spec, self._on_member)
        self._task: asyncio.Task[None] | None = None
        self.given_up: str | None = None
        """Why the supervisor stopped acting (None while it supervises)."""
        self.recoveries: list[Recovery] = []
        self._last_error: BaseException | None = None

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
        elif event.change is Change.REPLACED:
            first = self._down_since.pop(event.name, event.at)
            self._replaced.setdefault(event.name, first)
        else:
            self._down_since.pop(event.name, None)
        self._wake.set()

    # -- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        await self._check_members_on_start()
        while self.given_up is None:
            try:
                if self._replaced:
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

    async def _check_members_on_start(self) -> None:
        """A member started closed needs a recovery now (no event will ever announce it)."""
        wait = 0.5
        while True:
            try:
                fleet = await self._discover(self.spec)
                break
            except DiscoveryError as error:
                log.warning("supervisor: waiting for every member to answer (%s)", error)
                await asyncio.sleep(wait)
                wait = min(10.0, wait * 2)
        async with fleet:
            for member in fleet.members:
                with contextlib.suppress(ControlError):
                    if awaiting_restore(await member.client.get_status()):
                        self._replaced.setdefault(member.name, time.time())

    # -- checkpoints ----------------------------------------------------------------------

    async def _checkpoint(self) -> None:
        assert self.settings.checkpoint_every is not None
        self._next_checkpoint = time.monotonic() + self.settings.checkpoint_every
        if self.watch.down():
            log.info("supervisor: checkpoint skipped, members down: %s", sorted(self.watch.down()))
            return
        deadline = time.time() + self.settings.checkpoint_seconds
        try:
            checkpoint_id = await store_call(
                deadline, self.root.location, self.root.new_checkpoint_id
            )
        except PublicationError as error:
            log.warning("supervisor: checkpoint skipped: %s", error)
            return
        outcome: CheckpointOutcome | None = None
        try:
            fleet = await self._discover(self.spec)
        except DiscoveryError as error:
            log.info("supervisor: checkpoint skipped (%s)", error)
            return
        try:
            async with fleet:
                async for event in checkpoint(
                    fleet,
                    self.root,
                    deadline,
                    checkpoint_id=checkpoint_id,
                    scope=DERIVE,
                    keep=self.spec.keep,
                    asynchronous=self.spec.async_commit,
                ):
                    if event.outcome is not None:
                        outcome = event.outcome
        except (FleetError, PublicationError, CheckpointError) as error:
            if isinstance(error, CheckpointError) and "awaitingRestore" in error.metadata:
                # A replacement the watch has not reported yet: recover before anything else.
                for name in error.metadata["awaitingRestore"].split(","):
                    self._replaced.setdefault(name, self._down_since.get(name, time.time()))
            self.events.emit(
                checkpoint_not_published=cpb.CheckpointNotPublished(
                    checkpoint_id=checkpoint_id, error=status_of(_fleet_error(error))
                )
            )
            return
        assert outcome is not None
        if outcome.published is None:
            progress = outcome.progress
            self.events.emit(
                checkpoint_not_published=cpb.CheckpointNotPublished(
                    checkpoint_id=checkpoint_id,
                    prepare_outcome=prepare_outcome(outcome.prepare_outcome),
                    blockers=listed_blockers(progress) if progress is not None else [],
                )
            )
            return
        log.info(
            "supervisor: published %s (%d continued, %d records, %d bytes)",
            checkpoint_id,
            len(outcome.continued),
            outcome.record_count,
            outcome.bytes,
        )
        self.events.emit(
            checkpoint_published=cpb.CheckpointPublished(
                checkpoint_id=checkpoint_id,
                directory=str(outcome.published.directory),
                continued=[episode_message(e) for e in outcome.continued],
                record_count=outcome.record_count,
                bytes=outcome.bytes,
            )
        )

    # -- recoveries -----------------------------------------------------------------------

    async def _recover(self) -> None:
        """One recovery try, or giving up when the strategy's limit is reached.

        A replaced member lost its state whether or not it started closed (a replacement
        started open, or opened by a Resume, holds nothing of the fleet's state either), so
        every replacement leads to a recovery; one that another supervisor already finished
        is recognized by its id and only completed (`recovery.recover`)."""
        now = time.time()
        window = self.settings.strategy.window_seconds
        while self._tries and self._tries[0] < now - window:
            self._tries.popleft()
        if len(self._tries) >= self.settings.strategy.max_tries:
            await self._give_up(
                f"{len(self._tries)} recovery tries within {window:g} s failed "
                f"(strategy limit {self.settings.strategy.max_tries})"
            )
            return
        first_sign = min(self._replaced.values())
        deadline = now + self.settings.recovery_seconds
        try:
            await self._wait_for_members(deadline)
            fleet = await self._discover(self.spec)
        except (DiscoveryError, TimeoutError) as error:
            await self._failed_try(self._start_try(now), error)
            return
        async with fleet:
            try:
                latest = await store_call(deadline, self.root.location, self.root.latest)
            except PublicationError as error:
                await self._failed_try(self._start_try(now), error)
                return
            boot_ids = {m.name: m.boot_id for m in fleet.members}
            try_number = self._start_try(now, latest, recovery_id(latest, boot_ids))
            try:
                recovery = await recover(fleet, self.root, deadline)
            except (FleetError, PublicationError, RecoveryLostRace) as error:
                await self._failed_try(try_number, error)
                return
        self._replaced.clear()
        self._tries.clear()
        self.recoveries.append(recovery)
        # Checkpoint the recovered fleet at once: until a checkpoint names the restored
        # attempts N+1, a second crash could only restore N+1 again, which the survivors that
        # already ran it have retired.
        self._next_checkpoint = time.monotonic()
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

    def _start_try(self, now: float, latest: str | None = None, control_id: str = "") -> int:
        """Count a try against the strategy and announce it; returns its number."""
        self._tries.append(now)
        log.info(
            "supervisor: recovery try %d starts (replaced: %s)",
            len(self._tries),
            ", ".join(sorted(self._replaced)),
        )
        self.events.emit(
            recovery_started=cpb.RecoveryStarted(
                recovery_id=control_id,
                replaced_members=sorted(self._replaced),
                try_number=len(self._tries),
                source_checkpoint_id=latest or "",
            )
        )
        return len(self._tries)

    async def _failed_try(self, try_number: int, error: BaseException) -> None:
        """Report a failed try and wait out its backoff (the members are left as they are:
        the next try replays where this one succeeded)."""
        self._last_error = error
        strategy = self.settings.strategy
        backoff = min(
            strategy.max_backoff_seconds, strategy.backoff_seconds * 2 ** (try_number - 1)
        )
        self.events.emit(
            recovery_failed=cpb.RecoveryFailed(
                error=status_of(_fleet_error(error)), retry_in=duration(backoff)
            )
        )
        log.warning(
            "supervisor: recovery try %d failed (%s); next in %g s", try_number, error, backoff
        )
        await asyncio.sleep(backoff)

    async def _wait_for_members(self, deadline: float) -> None:
        while self.watch.down() or set(self._replaced) - set(self.watch.boot_ids()):
            remaining = deadline - time.time()
            if remaining <= 0:
                raise TimeoutError(f"members still down: {', '.join(sorted(self.watch.down()))}")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)

    async def _give_up(self, reason: str) -> None:
        error = self._last_error
        text = f"{reason}; last failure: {error}" if error is not None else reason
        self.given_up = text
        await self._undo_last_try()
        log.error("supervisor: giving up: %s", text)
        event = cpb.RecoveryGivenUp(reason=text)
        if error is not None:
            event.error.CopyFrom(status_of(_fleet_error(error)))
        self.events.emit(recovery_given_up=event)

    async def _undo_last_try(self) -> None:
        """All or nothing: no member may stay with half a restore (best effort)."""
        deadline = time.time() + self.settings.recovery_seconds
        undone = await undo_unfinished_recovery(self.spec, self.root, deadline)
        if undone:
            log.warning("supervisor: undid the unfinished recovery on %s", ", ".join(undone))


def _fleet_error(error: BaseException) -> BaseException:
    """The error as `status_of` can encode it (a fleet refusal, or the coordinator's own)."""
    if isinstance(error, (FleetError, CheckpointError)):
        return error
    if isinstance(error, RecoveryLostRace):
        return error.error
    if isinstance(error, (DiscoveryError, TimeoutError)):
        return CheckpointError(Reason.PARTICIPANT_UNREACHABLE, str(error), code="UNAVAILABLE")
    if isinstance(error, PublicationError):
        return as_checkpoint_error(error)
    return CheckpointError(Reason.INVALID_CHECKPOINT_STATE, str(error), code="FAILED_PRECONDITION")
