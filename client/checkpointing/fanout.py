"""Fleet coordination: the ordering, fan-out and all-or-nothing rules over many participants.

A stateless library: every call is safe to retry with the same checkpoint id, because the
participants keep the state (and replay recorded results). Each rule prevents a loss:

* Prepare goes stage by stage (environment, model, agent, resources) and stops at the first
  stage not prepared by the deadline: closing a later stage would starve the episodes that
  the unready stage still waits on.
* Resume goes in reverse, so no server reopens before the servers it calls.
* Retire and Forget go callers before callees, so a caller cannot send a late request to a
  callee that already forgot the attempt.
* Restore is all or nothing: a fleet where some members restored and others did not would
  continue rollouts with half their state.

Within a stage every member is called concurrently, at most `fleet.spec.fan_out` at once
(`DEFAULT_FAN_OUT`, 64): a bounded fan-out keeps a 1,000-member stage from opening every call
in one burst (see `fan_out`). Stages stay sequential: that is the ordering above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DEFAULT_FAN_OUT, Fleet, Kind, Member
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

CLEANUP_SECONDS = 30.0
PROGRESS_INTERVAL_SECONDS = 0.02
"""Least time between two progress snapshots of a prepare (the outcome never waits for it).
Every snapshot lists every member, and the CoordinatorService sends each as a message: one
per arriving update cost it 0.9 ms of CPU per member at 1,000 members (about 700 snapshots
of 1,000 members each), a cost growing with the square of the fleet."""
MAX_LISTED_BLOCKERS = 100

PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED


class FleetError(Exception):
    """One or more members refused (or could not be reached) during a fleet operation.

    `reason` is `PARTICIPANT_UNREACHABLE` when every failure is a transport failure, else
    `PARTICIPANT_FAILED`; `failures` maps member names to their errors."""

    def __init__(
        self, operation: str, failures: dict[str, ControlError], cause: Exception | None = None
    ) -> None:
        self.operation = operation
        self.failures = dict(sorted(failures.items()))
        self.cause = cause
        detail = "; ".join(
            f"{name}: {error.reason or error.code.name}: {error.message}"
            for name, error in self.failures.items()
        )
        super().__init__(f"{operation} failed on {len(failures)} member(s): {detail}")

    @property
    def reason(self) -> str:
        """`PARTICIPANT_UNREACHABLE` when no member decided (every failure is a transport
        failure: the outcome on the members is unknown, a retry may succeed), else
        `PARTICIPANT_FAILED`."""
        if all(not e.decided_by_server for e in self.failures.values()):
            return Reason.PARTICIPANT_UNREACHABLE
        return Reason.PARTICIPANT_FAILED

    @property
    def code(self) -> grpc.StatusCode:
        """The gRPC code a service reports this failure with: UNAVAILABLE when no member was
        reached, else the first refusing member's own code."""
        if self.reason == Reason.PARTICIPANT_UNREACHABLE:
            return grpc.StatusCode.UNAVAILABLE
        return next(e.code for e in self.failures.values() if e.decided_by_server)

    def failed_members(self) -> str:
        """`name=REASON,...` of every failed member (`UNREACHABLE` for a transport failure):
        the `failedMembers` metadata of the error a service returns."""
        return ",".join(
            f"{name}={error.reason or 'UNREACHABLE'}" for name, error in self.failures.items()
        )


# -- prepare --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberProgress:
    """One member's part of a `FleetProgress` (frozen: snapshots share unchanged entries)."""

    name: str
    """The member's fleet-file name."""
    kind: Kind
    """Its participant kind (its stage)."""
    reached: bool = False
    """Whether the prepare reached its stage (members of later stages are not called yet)."""
    state: types_pb2.ParticipantState.ValueType = types_pb2.PARTICIPANT_STATE_UNSPECIFIED
    """Its state as its last update reported it."""
    readiness: types_pb2.ReadinessReport = field(default_factory=types_pb2.ReadinessReport)
    """Its last readiness report: what still blocks it (the blockers it lists and their count)."""
    done: bool = False
    """Whether its prepare stream ended (its final message was its outcome)."""
    error: ControlError | None = None
    """Its refusal or transport failure, when its prepare failed."""


class Outcome:
    """How a fleet prepare ended (`FleetProgress.outcome`): every member PREPARED; a stage
    NOT_PREPARED by the deadline; or ENDED, a member of the stage IDLE again (the checkpoint
    ended on it before it prepared). Only PREPARED may be committed; the caller resumes the
    fleet otherwise (`checkpoint` does)."""

    PREPARED = "PREPARED"
    """Every member of every stage is PREPARED: the fleet may be committed."""
    NOT_PREPARED = "NOT_PREPARED"
    """A stage was not prepared by the deadline."""
    ENDED = "ENDED"
    """A member of the stage is IDLE again: the checkpoint ended on it before it prepared."""


@dataclass
class FleetProgress:
    """A snapshot of the fleet's prepare. `outcome` is set on the last one only."""

    stage: Kind
    """The stage being prepared (the last one reached, in the last snapshot)."""
    members: list[MemberProgress]
    """Every member's progress, in the fleet's order (by stage, then name)."""
    sequence: int
    """The snapshot's number within this prepare, from 1."""
    elapsed: float
    """Seconds since the prepare started."""
    outcome: str | None = None
    """How the prepare ended (`Outcome`); set on the last snapshot only."""

    @property
    def prepared(self) -> bool:
        """Whether this is the last snapshot and every member prepared."""
        return self.outcome == Outcome.PREPARED

    def blockers(self) -> list[tuple[str, types_pb2.Blocker]]:
        """(member, blocker) of every reached member not yet prepared."""
        found: list[tuple[str, types_pb2.Blocker]] = []
        for member in self.members:
            if member.reached and member.state != PREPARED:
                found.extend((member.name, b) for b in member.readiness.blockers)
        return found

    def blocker_count(self) -> int:
        """How many blockers the reached, unprepared members report (their counts, which
        may exceed the blockers they list)."""
        return sum(
            m.readiness.blocker_count for m in self.members if m.reached and m.state != PREPARED
        )

    def blocking_episodes(self) -> set[EpisodeId]:
        """The episodes the listed blockers name (a blocker without one is left out)."""
        episodes = set()
        for _, blocker in self.blockers():
            if blocker.capture_key:
                with contextlib.suppress(ValueError):
                    episodes.add(EpisodeId.from_capture_key(blocker.capture_key))
        return episodes


async def prepare(
    fleet: Fleet,
    checkpoint_id: str,
    deadline: float,
    *,
    progress_interval: float = PROGRESS_INTERVAL_SECONDS,
) -> AsyncIterator[FleetProgress]:
    """Prepare stage by stage, yielding a snapshot whenever members' progress arrives
    (every update already received goes into the same snapshot), at most one per
    `progress_interval` seconds: updates arriving sooner wait for the next one, except those
    that end a stage.

    The last snapshot has `outcome` set, and carries the updates that ended its stage (no
    snapshot of their own precedes it: the consumer learns the outcome a turn sooner). A
    member's refusal raises `FleetError` once every member of its stage has answered (its
    first update or its own refusal), so the error names every member that refused, not just
    the fastest; then the other streams of the stage are cancelled, which does not abort
    anything: Resume does. Members answer at once
    (the first update is immediate), and each stream is bounded by the deadline. At most
    `fleet.spec.fan_out` streams of a stage wait for their first update at once; a stream
    that answered stays open without holding a slot, so a member still draining never keeps
    the rest of its stage from closing admission. A member's final message is its outcome:
    the stage goes on without waiting for the stream's status, which is read behind it."""
    started = time.monotonic()
    starting = asyncio.Semaphore(fleet.spec.fan_out)
    progress = {m.name: MemberProgress(m.name, m.kind) for m in fleet.members}
    sequence = 0
    next_snapshot = 0.0

    def snapshot(stage: Kind, outcome: str | None = None) -> FleetProgress:
        # Entries are frozen and replaced on change, so a snapshot shares them: copying
        # every member per update made a 1,000-member prepare quadratic (seconds of CPU).
        nonlocal sequence
        sequence += 1
        members = [progress[m.name] for m in fleet.members]
        return FleetProgress(stage, members, sequence, time.monotonic() - started, outcome)

    stages = fleet.stages()
    for number, (stage, members) in enumerate(stages, start=1):
        for member in members:
            progress[member.name] = replace(progress[member.name], reached=True)
        updates: asyncio.Queue[tuple[str, pb.PrepareResponse | ControlError | None]] = (
            asyncio.Queue()
        )
        readers = [
            asyncio.ensure_future(_read_prepare(m, checkpoint_id, deadline, updates, starting))
            for m in members
        ]
        try:
            pending = len(members)
            unanswered = {m.name for m in members}
            failures: dict[str, ControlError] = {}
            closing = False  # the stage's last updates, not yet in a snapshot
            while pending and not (failures and not unanswered):
                # Every update already queued goes into one snapshot: a stage of 1,000
                # answering at once is a few snapshots, not 1,000 of 1,000 members each.
                changed = False
                name, update = await updates.get()
                while True:
                    unanswered.discard(name)
                    if update is None:
                        pending -= 1
                        progress[name] = replace(progress[name], done=True)
                    elif isinstance(update, ControlError):
                        pending -= 1
                        progress[name] = replace(progress[name], error=update)
                        failures[name] = update
                    else:
                        progress[name] = replace(
                            progress[name], state=update.state, readiness=update.readiness
                        )
                        changed = True
                    if not pending or (failures and not unanswered):
                        break
                    if not updates.empty():
                        name, update = updates.get_nowait()
                        continue
                    wait = next_snapshot - time.monotonic() if changed else 0.0
                    if wait <= 0:
                        break
                    try:
                        async with asyncio.timeout(wait):
                            name, update = await updates.get()
                    except TimeoutError:
                        break
                if changed and not pending and not failures:
                    closing = True
                elif changed:
                    next_snapshot = time.monotonic() + progress_interval
                    yield snapshot(stage)
            if failures:
                raise FleetError("prepare", failures)
        finally:
            await _end_readers(readers, [progress[m.name].done for m in members])
        states = {progress[m.name].state for m in members}
        if states != {PREPARED}:
            ended = any(s == types_pb2.PARTICIPANT_STATE_IDLE for s in states)
            yield snapshot(stage, Outcome.ENDED if ended else Outcome.NOT_PREPARED)
            return
        if closing and number < len(stages):
            # A stage's last updates go out with the outcome when there is one (here, or
            # after the last stage): a snapshot of their own cost the consumer (the
            # CoordinatorService: a stream message) a turn on the way to PREPARED.
            yield snapshot(stage)
    last_stage = stages[-1][0] if fleet.members else types_pb2.PARTICIPANT_KIND_UNSPECIFIED
    yield snapshot(last_stage, Outcome.PREPARED)


async def _read_prepare(
    member: Member,
    checkpoint_id: str,
    deadline: float,
    updates: asyncio.Queue[tuple[str, pb.PrepareResponse | ControlError | None]],
    starting: asyncio.Semaphore,
) -> None:
    """Relay one member's Prepare stream to `updates`, then None (or its `ControlError`).

    Holds a slot of `starting` from the call until its first message (or its end).

    The Prepare is fenced to the process whose status this fleet checked
    (`Member.state_checked_boot_id`). A replacement refuses it untouched; its status is read
    then, and it is prepared after all unless it awaits its restore (the BOOT_ID_MISMATCH
    refusal is relayed then: a checkpoint names it `awaitingRestore`)."""
    holding = False
    ended = False
    try:
        await starting.acquire()
        holding = True
        for checked_again in (False, True):
            answered = False
            try:
                async for message in member.client.prepare(
                    checkpoint_id, deadline, expected_boot_id=member.state_checked_boot_id
                ):
                    answered = True
                    if holding:
                        holding = False
                        starting.release()
                    await updates.put((member.name, message))
                    if message.final and not ended:
                        # The member's outcome is in. Its stream's status follows a network
                        # turn later (0.3-0.6 ms measured) and says nothing more; waiting for
                        # it delayed every stage, and the fleet's PREPARED, by that much.
                        ended = True
                        await updates.put((member.name, None))
                break
            except ControlError as error:
                if answered or error.reason != Reason.BOOT_ID_MISMATCH:
                    raise
                if checked_again or not await _check_again(member):
                    member.state_checked_boot_id = ""  # another process: read it again
                    raise
    except ControlError as error:
        if not ended:
            await updates.put((member.name, error))
        return
    finally:
        if holding:
            starting.release()
    if not ended:
        await updates.put((member.name, None))


_FINISHING_READERS: set[asyncio.Future[None]] = set()
"""Readers past their member's final message, reading the stream's status (kept referenced
until they end, as asyncio requires of a task nobody awaits)."""


async def _end_readers(readers: Sequence[asyncio.Future[None]], ended: Sequence[bool]) -> None:
    """End a stage's readers: cancel those whose member has not ended its stream (that
    cancels the stream, not the checkpoint); let those past their final message read its
    status, so the member sees its stream completed rather than cancelled."""
    cancelled = []
    for reader, member_ended in zip(readers, ended, strict=True):
        if reader.done():
            continue
        if member_ended:
            _FINISHING_READERS.add(reader)
            reader.add_done_callback(_FINISHING_READERS.discard)
        else:
            reader.cancel()
            cancelled.append(reader)
    await asyncio.gather(*cancelled, return_exceptions=True)


async def _check_again(member: Member) -> bool:
    """Read the status of a member that refused a fenced Prepare (it is another process):
    True, with the new process checked, unless it awaits its restore (which no Prepare may
    reach: its part would be empty)."""
    member.state_checked_boot_id = ""
    try:
        status = await member.client.get_status()
    except ControlError:
        return False
    if awaiting_restore(status):
        return False
    member.state_checked_boot_id = status.boot_id
    return True


async def prepare_until_done(
    fleet: Fleet,
    checkpoint_id: str,
    deadline: float,
    on_progress: Callable[[FleetProgress], None] | None = None,
) -> FleetProgress:
    """`prepare` to its end, calling `on_progress` with every snapshot; returns the last one,
    whose `outcome` says how it ended."""
    last: FleetProgress | None = None
    async for snapshot in prepare(fleet, checkpoint_id, deadline):
        if on_progress is not None:
            on_progress(snapshot)
        last = snapshot
    assert last is not None and last.outcome is not None
    return last


# -- commit, scope --------------------------------------------------------------------------


@dataclass
class MemberTimes:
    """When each member's call went out and when its reply came back, by member name
    (`time.monotonic()`), and for an asynchronous commit when its part was durable: what a
    history record says of each member's commit or restore (`recording`).

    Filled by `fan_out` where each call starts and each reply arrives, so timing a fleet
    costs no call and no pass over the members; a member whose call failed has no reply
    time. Kept by the caller rather than returned: a commit that fails raises, and the
    members that did reply are still worth telling apart from the one that did not."""

    called: dict[str, float] = field(default_factory=dict)
    """When each member's call went out (once it had its slot of the fan-out)."""
    replied: dict[str, float] = field(default_factory=dict)
    """When each member's reply arrived (none for a call that failed)."""
    durable: dict[str, float] = field(default_factory=dict)
    """When each member's part was found durable (`await_parts`)."""

    def reply_seconds(self, name: str) -> float | None:
        """From `name`'s call to its reply (None: it never replied)."""
        return _between(self.called.get(name), self.replied.get(name))

    def durable_seconds(self, name: str) -> float | None:
        """From `name`'s call until its part was durable (None: it never was)."""
        return _between(self.called.get(name), self.durable.get(name))


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 6)


DERIVE = "derive"
"""Pass as `scope` to derive it: the union of every member's live episodes."""


@dataclass
class FleetCommit:
    """Every member's Commit reply, by member name, and the scope they committed (None:
    unscoped)."""

    members: dict[str, pb.CommitResponse]
    """Every member's Commit reply (its part's manifest and digest), by member name."""
    scope: frozenset[EpisodeId] | None
    """The episodes committed, or None for an unscoped commit (each member's exported ones)."""

    def record_count(self) -> int:
        """Records in every member's part."""
        return sum(r.manifest.record_count for r in self.members.values())

    def bytes(self) -> int:
        """Bytes of every member's records."""
        return sum(r.manifest.bytes for r in self.members.values())


async def derive_scope(fleet: Fleet) -> frozenset[EpisodeId]:
    """The union of every member's ListEpisodes (take it after prepare, when nothing moves)."""
    pages = await fan_out(
        "list episodes", fleet.members, lambda m: m.client.all_episodes(), fleet.spec.fan_out
    )
    return frozenset(
        EpisodeId(e.episode_id.rollout_id, e.episode_id.attempt)
        for episodes in pages.values()
        for e in episodes
    )


async def commit(
    fleet: Fleet,
    checkpoint_id: str,
    deadline: float,
    checkpoint_dir: str,
    scope: Iterable[EpisodeId] | str | None,
    *,
    asynchronous: bool = False,
    times: MemberTimes | None = None,
) -> FleetCommit:
    """Commit every member at once; `scope` explicit, `DERIVE`, or None (unscoped).

    `asynchronous`: every member answers at its snapshot (`snapshot_only` replies, no
    manifests yet); `await_parts` then waits for every part to be durable. `times`: when
    each member's Commit was called and answered (the scope's derivation is not timed)."""
    if scope == DERIVE:
        resolved: frozenset[EpisodeId] | None = await derive_scope(fleet)
    elif scope is None:
        resolved = None
    else:
        assert not isinstance(scope, str)
        resolved = frozenset(scope)
    replies = await fan_out(
        "commit",
        fleet.members,
        lambda m: m.client.commit(
            checkpoint_id, deadline, checkpoint_dir, resolved, asynchronous=asynchronous
        ),
        fleet.spec.fan_out,
        times,
    )
    return FleetCommit(replies, resolved)


AWAIT_PART_POLL_SECONDS = 5.0
"""How long one AwaitPart call waits at most: a long poll, so a member that was killed
during its write is noticed (its call fails) within this, not at the checkpoint's deadline."""

AWAIT_PART_TRANSPORT_RETRIES = 3


async def await_parts(
    fleet: Fleet,
    checkpoint_id: str,
    snapshots: FleetCommit,
    deadline: float,
    times: MemberTimes | None = None,
) -> FleetCommit:
    """Wait until every member's part of an asynchronous commit is durable; the commit with
    every reply completed (manifest and digest), as a synchronous commit would have answered.

    Raises `FleetError` ("await part") naming every member whose part failed (the reason its
    write gave: `STORAGE_FAILED`, ...), whose process no longer knows the write (UNKNOWN: it
    was replaced, so its snapshot is gone), that could not be reached, or that was still
    writing at `deadline` (`CHECKPOINT_DEADLINE_EXCEEDED`). Only this checkpoint fails: the
    fleet was resumed already, and nothing names an unfinished part.

    `times` (the commit's): when each member's part was found durable is added to it."""

    async def durable(member: Member) -> pb.CommitResponse:
        snapshot = snapshots.members[member.name]
        if not snapshot.snapshot_only:
            # A participant that predates asynchronous commits ignored the field and
            # committed synchronously: its part is durable already, since its reply.
            if times is not None and member.name in times.replied:
                times.durable[member.name] = times.replied[member.name]
            return snapshot
        transport_failures = 0
        while True:
            wait_until = min(deadline, time.time() + AWAIT_PART_POLL_SECONDS)
            try:
                reply = await member.client.await_part(checkpoint_id, wait_until)
            except ControlError as error:
                transport_failures += 1
                if error.decided_by_server or transport_failures > AWAIT_PART_TRANSPORT_RETRIES:
                    raise
                await asyncio.sleep(0.2 * transport_failures)
                continue
            if reply.state == pb.PART_WRITE_STATE_DURABLE:
                if times is not None:
                    times.durable[member.name] = time.monotonic()
                done = pb.CommitResponse()
                done.CopyFrom(snapshot)
                done.snapshot_only = False
                done.manifest.CopyFrom(reply.manifest)
                done.manifest_sha256 = reply.manifest_sha256
                return done
            if reply.state == pb.PART_WRITE_STATE_FAILED:
                raise ControlError(
                    grpc.StatusCode.UNAVAILABLE,
                    reply.failure_message,
                    reply.failure_reason or Reason.STORAGE_FAILED.value,
                )
            if reply.state != pb.PART_WRITE_STATE_WRITING:
                raise ControlError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the participant holds no write of this checkpoint (replaced since its "
                    "snapshot?): its part will never be durable",
                    Reason.STORAGE_FAILED.value,
                )
            if time.time() >= deadline:
                raise ControlError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "the part was still being written at the checkpoint's deadline",
                    Reason.CHECKPOINT_DEADLINE_EXCEEDED.value,
                )

    replies = await fan_out("await part", fleet.members, durable, fleet.spec.fan_out)
    return FleetCommit(replies, snapshots.scope)


# -- restore --------------------------------------------------------------------------------


async def restore(
    fleet: Fleet,
    checkpoint_id: str,
    deadline: float,
    checkpoint_dir: str,
    scope: Iterable[EpisodeId],
    *,
    rejoin: bool = False,
    times: MemberTimes | None = None,
) -> dict[str, pb.RestoreResponse]:
    """Restore every member, all or nothing (`times`: when each Restore was called and
    answered).

    `rejoin`: members may have served (the survivors of a crash whose crashed member was
    replaced): each first retires every episode it holds and forgets having served; a fresh
    member restores as without it.

    On any failure: retire the next attempts (N+1) of every scoped episode everywhere (which
    frees whatever got installed and refuses those attempts until forgotten), resume every
    member even if that retire failed somewhere, then raise naming the failed members. The
    controller restarts those rollouts from their inputs as later attempts."""
    episodes = frozenset(scope)
    try:
        return await fan_out(
            "restore",
            fleet.members,
            lambda m: m.client.restore(
                checkpoint_id, deadline, checkpoint_dir, episodes, rejoin=rejoin
            ),
            fleet.spec.fan_out,
            times,
        )
    except FleetError as failure:
        await abandon_restore(fleet, checkpoint_id, episodes, deadline)
        raise FleetError("restore", failure.failures) from None
    except asyncio.CancelledError:
        # Interrupted (Ctrl-C, SIGTERM): some members may have installed already.
        await abandon_restore(fleet, checkpoint_id, episodes, deadline)
        raise


async def abandon_restore(
    fleet: Fleet, checkpoint_id: str, episodes: Iterable[EpisodeId], deadline: float
) -> None:
    """Undo a restore that did not complete everywhere: retire the next attempts (N+1) of
    every scoped episode on every member (which frees whatever got installed), then resume
    every member even if that retire failed somewhere. Best effort: the caller reports the
    restore's own failure; a failure here is logged and passed over (a member that cannot
    be reached reopens when its lease expires)."""
    cleanup_deadline = max(deadline, time.time() + CLEANUP_SECONDS)
    # An episode at the highest attempt has no next one: nothing of it can be installed.
    next_attempts = sorted(e.next_attempt() for e in episodes if e.attempt < MAX_ATTEMPT)
    if next_attempts:
        try:
            await fan_out(
                "retire",
                fleet.members,
                lambda m: m.client.retire(checkpoint_id, cleanup_deadline, next_attempts),
                fleet.spec.fan_out,
            )
        except FleetError as error:
            # Nothing continues those attempts (the controller restarts the rollouts as later
            # attempts), so at worst their installed state stays allocated on these members
            # until the process restarts.
            log.warning(
                "restore %s failed; freeing its next attempts afterwards failed too (%s): "
                "going on, nothing will continue those attempts",
                checkpoint_id,
                error,
            )
    try:
        await resume(fleet, checkpoint_id, cleanup_deadline)
    except FleetError as error:
        log.warning(
            "restore %s failed; resuming the fleet afterwards failed too (%s): going on, "
            "those members reopen on their own when their lease expires",
            checkpoint_id,
            error,
        )


# -- resume, retire, forget, renew ----------------------------------------------------------


async def resume(
    fleet: Fleet, checkpoint_id: str, deadline: float, *, sparing: Collection[str] = ()
) -> dict[str, pb.ResumeResponse]:
    """Reverse stage order; a failing member does not stop the others (raised at the end).

    `sparing`: members not to call (a replacement that refused the Prepare: resuming it
    would open a process that may await its restore)."""
    replies: dict[str, pb.ResumeResponse] = {}
    failures: dict[str, ControlError] = {}
    for _, members in reversed(fleet.stages()):
        members = [m for m in members if m.name not in sparing]
        if not members:
            continue
        try:
            replies.update(
                await fan_out(
                    "resume",
                    members,
                    lambda m: m.client.resume(checkpoint_id, deadline),
                    fleet.spec.fan_out,
                )
            )
        except FleetError as error:
            failures.update(error.failures)
    if failures:
        raise FleetError("resume", failures)
    return replies


def _caller_groups(fleet: Fleet) -> list[list[Member]]:
    """Callers before callees: environment, then agent, then model and resources together."""
    by_kind = {kind: [m for m in fleet.members if m.kind == kind] for kind, _ in fleet.stages()}
    groups = [
        by_kind.get(types_pb2.PARTICIPANT_KIND_ENVIRONMENT, []),
        by_kind.get(types_pb2.PARTICIPANT_KIND_AGENT, []),
        by_kind.get(types_pb2.PARTICIPANT_KIND_MODEL, [])
        + by_kind.get(types_pb2.PARTICIPANT_KIND_RESOURCES, []),
    ]
    return [g for g in groups if g]


async def retire(
    fleet: Fleet, checkpoint_id: str, deadline: float, episodes: Sequence[EpisodeId]
) -> None:
    """Retire `episodes` (those attempts end for good) on every member, callers before
    callees (`_callers_first`)."""
    await _callers_first(
        "retire", fleet, lambda m: m.client.retire(checkpoint_id, deadline, episodes)
    )


async def forget(
    fleet: Fleet, checkpoint_id: str, deadline: float, rollout_ids: Sequence[str]
) -> None:
    """Forget `rollout_ids` (every attempt, and what is recorded of them) on every member,
    callers before callees (`_callers_first`)."""
    await _callers_first(
        "forget", fleet, lambda m: m.client.forget(checkpoint_id, deadline, rollout_ids)
    )


async def _callers_first(
    operation: str, fleet: Fleet, call: Callable[[Member], Awaitable[Any]]
) -> None:
    """`call` on every member, one caller group after the other: a caller that still ran an
    attempt could otherwise send a late request to a callee that already ended it."""
    for group in _caller_groups(fleet):
        await fan_out(operation, group, call, fleet.spec.fan_out)


async def renew(fleet: Fleet, checkpoint_id: str, deadline: float) -> float:
    """Renew everywhere; returns the earliest lease expiry."""
    replies = await fan_out(
        "renew",
        fleet.members,
        lambda m: m.client.renew(checkpoint_id, deadline),
        fleet.spec.fan_out,
    )
    return min(r.lease_expires_at.ToNanoseconds() / 1e9 for r in replies.values())


# -- stragglers -----------------------------------------------------------------------------


@dataclass
class StragglerResult:
    progress: FleetProgress
    checkpoint_id: str
    rounds: int
    retired: list[EpisodeId]


async def prepare_retiring_stragglers(
    fleet: Fleet,
    new_checkpoint_id: Callable[[], str],
    deadline_for_round: Callable[[], float],
    *,
    rounds: int = 2,
    on_progress: Callable[[FleetProgress], None] | None = None,
) -> StragglerResult:
    """Prepare; if not ready: resume, retire the blocking episodes, prepare again with a new id.

    Bounded by `rounds` extra attempts. Retired rollouts restart from their inputs as later
    attempts (the controller must forget them once nothing of them can run)."""
    retired: list[EpisodeId] = []
    checkpoint_id = new_checkpoint_id()
    progress = await prepare_until_done(fleet, checkpoint_id, deadline_for_round(), on_progress)
    for round_number in range(1, rounds + 1):
        if progress.prepared:
            return StragglerResult(progress, checkpoint_id, round_number - 1, retired)
        blocking = sorted(progress.blocking_episodes())
        await resume(fleet, checkpoint_id, deadline_for_round())
        if blocking:
            await retire(fleet, checkpoint_id, deadline_for_round(), blocking)
            retired.extend(blocking)
        checkpoint_id = new_checkpoint_id()
        progress = await prepare_until_done(fleet, checkpoint_id, deadline_for_round(), on_progress)
    return StragglerResult(progress, checkpoint_id, rounds, retired)


def awaiting_restore(status: pb.GetStatusResponse) -> bool:
    """Whether a member is a `start_closed` process waiting for its Restore or Resume: IDLE
    with admission closed happens in no other case (types.proto, ParticipantState). Such a
    member holds none of the fleet's state yet."""
    return status.state == types_pb2.PARTICIPANT_STATE_IDLE and not status.admission_open


# -- fan-out --------------------------------------------------------------------------------


async def fan_out(
    operation: str,
    members: Sequence[Member],
    call: Callable[[Member], Awaitable[T]],
    limit: int = DEFAULT_FAN_OUT,
    times: MemberTimes | None = None,
) -> dict[str, T]:
    """Call every member concurrently, at most `limit` calls at once (pass
    `fleet.spec.fan_out`); the replies by member name, or one `FleetError` naming every member
    whose call raised a `ControlError` (any other exception is raised as it is), once every
    call ended. Public for controllers that call members directly (`collect`).

    `times`: when each call started (once it had its slot: the wait for one is the fan-out
    bound's, not the member's) and when each reply arrived."""
    slots = asyncio.Semaphore(limit)

    async def bounded(member: Member) -> T:
        async with slots:
            if times is None:
                return await call(member)
            times.called[member.name] = time.monotonic()
            reply = await call(member)
            times.replied[member.name] = time.monotonic()
            return reply

    results = await asyncio.gather(*(bounded(m) for m in members), return_exceptions=True)
    replies: dict[str, T] = {}
    failures: dict[str, ControlError] = {}
    for member, result in zip(members, results, strict=True):
        if isinstance(result, ControlError):
            failures[member.name] = result
        elif isinstance(result, BaseException):
            raise result
        else:
            replies[member.name] = result
    if failures:
        raise FleetError(operation, failures)
    return replies


def describe_failures(error: FleetError) -> dict[str, Any]:
    return {
        name: {
            "code": e.code.name,
            "reason": e.reason,
            "message": e.message,
            "metadata": e.metadata,
        }
        for name, e in error.failures.items()
    }
