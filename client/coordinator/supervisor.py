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
* **The coordinator keeps no state, and mends what a dead one left.** On start it reads every
  member's state (GetStatus) and finishes or undoes whatever it finds: a member started
  closed (a replacement that came up while no supervisor ran, or a fresh install) or a
  member RESTORED under a recovery id (a supervisor killed between restore and resume, or
  whose Resume did not reach it) triggers a recovery at once, which replays the restore under
  the same derived id and resumes (`recovery_finished` is announced then, with the continued
  rollouts); a member PREPARING, PREPARED or COMMITTED (a checkpoint cut by the kill) is
  resumed with its checkpoint's id. Otherwise the fleet would stay closed until the lease
  expires (minutes), and a trainer would never learn which rollouts to re-send. A member
  that comes back with the same boot id (a pause, a network cut) is read again the same way:
  a Resume that could not reach it left it closed. A fresh install has no `LATEST`, so its
  members are only opened.
* **A restart strategy bounds the tries**: at most `max_tries` recovery tries within
  `window_seconds` (succeeded or not, like Flink's failure-rate strategy: a member that is
  recovered and dies again, over and over, is a crash loop), with a doubling backoff after a
  failed one. A replacement that answered and died again before its recovery finished counts
  as a failed try too: a crash loop whose replacements live a second would otherwise never
  reach a try. A try that fails leaves the members
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

from rollout_checkpoint.client.checkpointing.checkpoint import CheckpointOutcome, Phase, checkpoint
from rollout_checkpoint.client.checkpointing.fanout import DERIVE, FleetError, awaiting_restore
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    as_checkpoint_error,
    open_checkpoint_root,
    store_call,
)
from rollout_checkpoint.client.coordinator.calls import (
    listed_blockers,
    prepare_outcome,
    status_of,
)
from rollout_checkpoint.client.coordinator.fleet_events import FleetEventLog
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.fleet.membership import Change, FleetWatch, MemberEvent
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.client.recovery import (
    RECOVERY_PREFIX,
    Recovery,
    RecoveryLostRace,
    StepHook,
    no_pause,
    recover,
    recovery_id,
    undo_unfinished_recovery,
)
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.rpc.wire import duration, episode_message
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

IDLE = types_pb2.PARTICIPANT_STATE_IDLE
RESTORED = types_pb2.PARTICIPANT_STATE_RESTORED
CHECK_SECONDS = 5.0
"""The timeout of one GetStatus of a member's state check."""

RECOVERY_ANNOUNCED = "recovery-announced"
"""The `StepHook` point after a recovery's `recovery_finished` went out, before the supervisor
forgets the replacements it restored."""

CHECKPOINT_STEPS = {
    Phase.COMMIT: "checkpoint-prepared",
    Phase.PUBLISH: "checkpoint-committed",
    Phase.RESUME: "checkpoint-published",
}
"""The `StepHook` points of a supervisor checkpoint, by the phase about to start: every member
PREPARED; COMMITTED, nothing published; COMMITTED and published, not resumed."""


@dataclass(frozen=True)
class RestartStrategy:
    """How often the supervisor tries to recover before it gives up."""

    max_tries: int = 3
    """Recovery tries allowed within `window_seconds`; one more gives up."""
    window_seconds: float = 600.0
    """The window `max_tries` counts tries in (a failure rate, like Flink's)."""
    backoff_seconds: float = 1.0
    """The wait after the first failed try; doubled after each further one."""
    max_backoff_seconds: float = 30.0
    """The longest wait between two tries, however many failed."""


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
    `CHECKPOINT_STEPS` name), logging "supervisor: paused at <point>" first: tests kill the
    coordinator process there, deterministically, to check that its successor mends the
    fleet (`coordinator --supervise` with `ROLLOUT_CHECKPOINT_TEST_PAUSE_AT` set)."""

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
        """Members whose state is to be read (`_check_members`): all on start, and each that
        comes back with the same boot id."""
        self._tried_boot_ids: set[str] = set()
        """Boot ids of replacements a try was counted for: their death is that try's failure,
        not another one."""
        self._tries: deque[float] = deque()
        self._crashes: list[str] = []
        """Replacements that died before their recovery finished (for the give-up reason)."""
        self._own_checkpoints: deque[str] = deque(maxlen=64)
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
            if event.name in self._replaced and event.boot_id:
                self._replacement_died(event)
        elif event.change is Change.REPLACED:
            first = self._down_since.pop(event.name, event.at)
            self._replaced.setdefault(event.name, first)
        else:
            if self._down_since.pop(event.name, None) is not None:
                # Back with the same boot id: a call of ours may have missed it (a Resume
                # that left it closed while its neighbours reopened).
                self._to_check.add(event.name)
        self._wake.set()

    def _replacement_died(self, event: MemberEvent) -> None:
        """A member awaiting its recovery answered and died again: a failed recovery of it.
        Counted here unless a try already counted for this process (a try it breaks fails
        by itself, and its failure may be reported before or after this death)."""
        text = f"{event.name} (boot id {event.boot_id}) died before the fleet was reopened"
        self._crashes.append(text)
        if event.boot_id in self._tried_boot_ids or self.given_up is not None:
            return
        self._tried_boot_ids.add(event.boot_id)
        self._tries.append(event.at)
        log.warning("supervisor: %s; recovery try %d counted failed", text, len(self._tries))
        self.events.emit(
            recovery_failed=cpb.RecoveryFailed(
                error=status_of(
                    CheckpointError(Reason.PARTICIPANT_UNREACHABLE, text, code="UNAVAILABLE")
                ),
                retry_in=duration(0.0),
            )
        )

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
        """Read the state of the members in `_to_check` and finish or undo what no live action
        of this supervisor holds (see the module docstring): no event will ever announce a
        member left closed. A member that does not answer stays to be checked (the watch
        reports it UP again). `on_start`: a checkpoint left open under any id was cut by a
        dead controller; later only this supervisor's own (an abort that missed a member) are
        known to be over, another live controller's may still be running."""
        names = sorted(self._to_check)
        self._to_check.clear()
        members = [m for m in self.spec.members if m.name in names]
        statuses = await asyncio.gather(*(self._status(m) for m in members))
        for member, status in zip(members, statuses, strict=True):
            if status is None:
                continue
            if awaiting_restore(status) or (
                status.state != IDLE and status.checkpoint_id.startswith(RECOVERY_PREFIX)
            ):
                log.info(
                    "supervisor: %s awaits a recovery (state %s, id %s)",
                    member.name,
                    types_pb2.ParticipantState.Name(status.state),
                    status.checkpoint_id or "-",
                )
                self._replaced.setdefault(member.name, time.time())
            elif status.state not in (IDLE, RESTORED) and (
                on_start or status.checkpoint_id in self._own_checkpoints
            ):
                await self._end_cut_checkpoint(member, status.checkpoint_id)

    async def _status(self, member: MemberSpec) -> pb.GetStatusResponse | None:
        async with self._client(member) as client:
            try:
                return await client.get_status()
            except ControlError as error:
                log.info("supervisor: reading %s's state failed (%s)", member.name, error)
                return None

    def _client(self, member: MemberSpec) -> ParticipantClient:
        return self.spec.client(member, timeout=CHECK_SECONDS, credentials=self.spec.credentials())

    async def _end_cut_checkpoint(self, member: MemberSpec, checkpoint_id: str) -> None:
        """Resume a member still inside a checkpoint that nothing will finish: published or
        not, its controller is gone, and the member would stay closed until its lease."""
        log.info("supervisor: ending checkpoint %s left open on %s", checkpoint_id, member.name)
        async with self._client(member) as client:
            try:
                await client.resume(checkpoint_id, time.time() + self.settings.checkpoint_seconds)
            except ControlError as error:
                # It is read again when the watch sees it come back; else its lease reopens it.
                log.warning("supervisor: resuming %s failed (%s)", member.name, error)

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
        self._own_checkpoints.append(checkpoint_id)
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
                    if event.phase in CHECKPOINT_STEPS:
                        await self.settings.step(CHECKPOINT_STEPS[event.phase])
                    if event.outcome is not None:
                        outcome = event.outcome
        except (FleetError, PublicationError, CheckpointError) as error:
            if isinstance(error, CheckpointError) and "awaitingRestore" in error.metadata:
                # A replacement the watch has not reported yet: recover before anything else.
                for name in error.metadata["awaitingRestore"].split(","):
                    self._replaced.setdefault(name, self._down_since.get(name, time.time()))
            elif isinstance(error, FleetError):
                # A member held by something else (a recovery left RESTORED, a checkpoint
                # this supervisor aborted without reaching it): read what it holds.
                self._to_check.update(error.failures)
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
        if self._strategy_exhausted():
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
            await self._failed_try(self._start_try(now), error)
            return
        async with fleet:
            try:
                latest = await store_call(deadline, self.root.location, self.root.latest)
            except PublicationError as error:
                await self._failed_try(self._start_try(now), error)
                return
            boot_ids = {m.name: m.boot_id for m in fleet.members}
            self._tried_boot_ids.update(boot_ids[name] for name in self._replaced)
            try_number = self._start_try(now, latest, recovery_id(latest, boot_ids))
            try:
                recovery = await recover(fleet, self.root, deadline, step=self.settings.step)
            except (FleetError, PublicationError, RecoveryLostRace) as error:
                await self._failed_try(try_number, error)
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
            self._crashes.clear()
            self._tried_boot_ids.clear()

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

    def _strategy_exhausted(self) -> bool:
        """Whether `max_tries` tries (a replacement dying before its recovery finished counts
        as one) fall within the window: every further try would be beyond the limit."""
        window = self.settings.strategy.window_seconds
        while self._tries and self._tries[0] < time.time() - window:
            self._tries.popleft()
        return len(self._tries) >= self.settings.strategy.max_tries

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
        """Wait until every member answers; raises `GaveUp` when replacements that died
        meanwhile exhausted the strategy, `TimeoutError` at `deadline`."""
        while self.watch.down() or set(self._replaced) - set(self.watch.boot_ids()):
            if self._strategy_exhausted():
                raise GaveUp
            remaining = deadline - time.time()
            if remaining <= 0:
                raise TimeoutError(f"members still down: {', '.join(sorted(self.watch.down()))}")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)

    async def _give_up(self) -> None:
        strategy = self.settings.strategy
        reason = (
            f"{len(self._tries)} recovery tries within {strategy.window_seconds:g} s "
            f"(strategy limit {strategy.max_tries})"
        )
        reason += f"; awaiting recovery: {', '.join(sorted(self._replaced))}"
        if self._crashes:
            reason += f"; replacements that died: {'; '.join(self._crashes[-5:])}"
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
