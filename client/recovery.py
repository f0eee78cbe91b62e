"""Recovering a fleet in place after a member was replaced: the whole fleet back to `LATEST`.

A replaced member lost its in-memory state; the survivors still hold theirs, newer than any
checkpoint. Continuing from that mix would run rollouts with half their state, so the whole
fleet goes back to the latest published checkpoint, all or nothing, exactly as a restore into
fresh processes does — the survivors take part through a *rejoining* Restore, which first
retires everything they hold (so no late request of a cut attempt can change the restored
state) and then installs like a fresh process. The rules, each for a crash or a race:

* **One id per recovery, derived from what it restores** (`recovery_id`: the source
  checkpoint and every member's boot id). Two supervisors that see the same fleet send the
  same Restore and Resume, which the members replay; a supervisor that sees another fleet
  (a further replacement) sends another id, which the members fence with
  CHECKPOINT_CONFLICT. Nothing a losing supervisor does can undo the winner's restore.
* **Checkpoints the crash cut are ended first** (a member still PREPARING, PREPARED,
  COMMITTED or RESTORED under another id is resumed with that id): Restore is allowed only
  in IDLE, and nothing will ever finish a checkpoint whose coordinator saw a member die.
* **A failed try is undone only on request** (`abandon_on_failure`). Undoing retires every
  restored attempt N+1 for good, so a supervisor that will try again leaves the members as
  they are (a retry with the same id replays where it succeeded); it undoes only when it
  gives up. A try that lost a race (CHECKPOINT_CONFLICT, STALE_CHECKPOINT: another
  controller's checkpoint or restore holds the fleet) is never undone by this one.
* **A recovery already done is finished, not repeated**: when every member answers the
  restore with STALE_CHECKPOINT, another supervisor already restored and resumed this very
  recovery (same id), so only its resume is completed.
* **No checkpoint yet** (a fresh install): the members started closed are opened; there is
  nothing to restore.

What the controller learns (`Recovery`): the continued rollouts as their new attempts, and the
rollouts that were in flight but are not continued (their attempts retired by the rejoin), to
restart from their inputs.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import RestoreSource, verified_source
from rollout_checkpoint.client.checkpointing.fanout import FleetError, awaiting_restore, fan_out
from rollout_checkpoint.client.checkpointing.publication import (
    NoPublishedCheckpoint,
    PublicationError,
    PublicationRoot,
    store_call,
)
from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.checkpointing.recording import RestoreRecorder
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

IDLE = types_pb2.PARTICIPANT_STATE_IDLE
RESTORED = types_pb2.PARTICIPANT_STATE_RESTORED
RECOVERY_PREFIX = "recover-"
LOST_RACE = frozenset({Reason.CHECKPOINT_CONFLICT, Reason.STALE_CHECKPOINT})


def recovery_id(source_checkpoint_id: str | None, boot_ids: Mapping[str, str]) -> str:
    """The control id of the recovery of this fleet (these boot ids) from this checkpoint
    (None: no checkpoint yet): the same for every supervisor that sees the same fleet."""
    text = "\n".join(
        [source_checkpoint_id or "-"] + [f"{n}={b}" for n, b in sorted(boot_ids.items())]
    )
    return RECOVERY_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:24]


class Step(enum.StrEnum):
    """The points between a recovery's steps, where `StepHook` is awaited. Each leaves the
    fleet in a state that a controller killed there leaves to its successor."""

    CUT_ENDED = "recovery-cut-ended"
    """Checkpoints the crash cut are ended; nothing is restored yet."""
    RESTORED = "recovery-restored"
    """Every member is RESTORED (closed) under the recovery's id; none is resumed."""


StepHook = Callable[[str], Awaitable[None]]
"""Awaited with the name of each point a controller passes (`Step`, the supervisor's
checkpoint points): tests pause or kill the controller there (`no_pause` otherwise)."""


async def no_pause(point: str) -> None:
    """The `StepHook` of a controller that nothing pauses."""


class RecoveryLostRace(Exception):
    """Another controller's checkpoint or restore holds (part of) the fleet: this recovery
    stopped without undoing anything. `error` is the members' refusal."""

    def __init__(self, error: FleetError) -> None:
        super().__init__(f"another controller holds the fleet: {error}")
        self.error = error


@dataclass(frozen=True)
class Recovery:
    """A finished recovery: the fleet is open again."""

    recovery_id: str
    """The id of every call of the recovery, derived from what it restores (`recovery_id`)."""
    source_checkpoint_id: str | None
    """None: there was no published checkpoint; the fresh members were only opened."""
    continued: tuple[EpisodeId, ...]
    """The continued rollouts as their new attempts (N+1), sorted."""
    restarted: tuple[EpisodeId, ...]
    """Rollouts in flight before the recovery that are not continued, each at the highest
    attempt that was retired (restart it from its input as the next one), sorted."""
    controller_state: bytes = b""
    """The controller state published with the restored checkpoint (empty without one)."""
    opened: tuple[str, ...] = ()
    """Members that were opened without a restore (no checkpoint yet)."""
    replayed: bool = False
    """Another supervisor had already restored this very recovery; this one only finished
    its resume (`restarted` is then empty: this one retired nothing)."""


async def recover(
    fleet: Fleet,
    root: PublicationRoot,
    deadline: float,
    *,
    source: str | None = None,
    scope: Iterable[EpisodeId] | None = None,
    abandon_on_failure: bool = False,
    step: StepHook = no_pause,
    trigger: str = Trigger.SUPERVISOR,
) -> Recovery:
    """Restore `source` (None: `LATEST`) into the whole fleet, survivors included, and resume
    it; with no checkpoint published yet, open the members started closed.

    `scope` (default: the checkpoint's continued episodes) is what is continued. Raises
    `FleetError` (members refused or unreachable; undone all or nothing first when
    `abandon_on_failure`), `RecoveryLostRace`, `PublicationError` (a corrupt checkpoint:
    nothing was installed anywhere). `step` is awaited between the steps (`Step`).

    A recovery that restores (or tries to) is recorded in the root's history (`trigger`:
    what started it); one that only opened a fresh fleet restored nothing and is not."""
    statuses = await fan_out(
        "status", fleet.members, lambda m: m.client.get_status(), fleet.spec.fan_out
    )
    boot_ids = {m.name: m.boot_id for m in fleet.members}
    recorder = RestoreRecorder(
        fleet,
        root,
        recovery_id(source, boot_ids),
        deadline,
        str(trigger),
        "rejoin",
        source=source or "LATEST",
    )
    try:
        verified = await verified_source(fleet, root, deadline, source=source, scope=scope)
    except NoPublishedCheckpoint:
        return await open_fresh(fleet, statuses, recovery_id(None, boot_ids), deadline)
    except Exception as error:
        await recorder.failed(error)
        raise
    recorder.source = verified.checkpoint_id
    recorder.restore_id = recovery_id(verified.checkpoint_id, boot_ids)
    try:
        recovery = await _restore_and_resume(
            fleet, verified, recorder, statuses, deadline, abandon_on_failure, step
        )
    except RecoveryLostRace as lost:
        await recorder.failed(lost.error)  # the members' refusal names who holds the fleet
        raise
    except Exception as error:
        await recorder.failed(error)
        raise
    await recorder.completed(len(recovery.continued), len(recovery.restarted))
    return recovery


async def _restore_and_resume(
    fleet: Fleet,
    verified: RestoreSource,
    recorder: RestoreRecorder,
    statuses: Mapping[str, pb.GetStatusResponse],
    deadline: float,
    abandon_on_failure: bool,
    step: StepHook,
) -> Recovery:
    """`recover`'s restore of a verified checkpoint, all or nothing, then its resume, under
    `recorder`'s id (each member's Restore timed into its `times`)."""
    control_id = recorder.restore_id
    await end_cut_checkpoints(fleet, statuses, control_id, deadline)
    await step(Step.CUT_ENDED)
    in_flight = await _live_episodes(fleet)
    episodes = frozenset(verified.continued)
    replayed = False
    try:
        await fan_out(
            "restore",
            fleet.members,
            lambda m: m.client.restore(
                control_id, deadline, verified.directory, episodes, rejoin=True
            ),
            fleet.spec.fan_out,
            recorder.times,
        )
    except FleetError as error:
        if all(e.reason == Reason.STALE_CHECKPOINT for e in error.failures.values()):
            # This very recovery (same checkpoint, same processes) was restored everywhere
            # (the others replayed it just now) and already resumed where it is stale: by
            # another supervisor that saw the same fleet, or by one that died, or whose
            # Resume did not reach the rest. Finish its resume.
            replayed = True
        elif any(e.reason in LOST_RACE for e in error.failures.values()):
            raise RecoveryLostRace(error) from None
        else:
            if abandon_on_failure:
                await fanout.abandon_restore(fleet, control_id, episodes, deadline)
            raise
    await step(Step.RESTORED)
    await fanout.resume(fleet, control_id, deadline)
    continued_rollouts = {e.rollout_id for e in episodes}
    restarted = (
        ()
        if replayed
        else _highest_attempts(e for e in in_flight if e.rollout_id not in continued_rollouts)
    )
    return Recovery(
        control_id,
        verified.checkpoint_id,
        continued=tuple(sorted(e.next_attempt() for e in episodes if e.attempt < MAX_ATTEMPT)),
        restarted=restarted,
        controller_state=verified.controller_state,
        replayed=replayed,
    )


async def undo_unfinished_recovery(
    spec: FleetSpec, root: PublicationRoot, deadline: float
) -> tuple[str, ...]:
    """Undo what failed recovery tries left behind, all or nothing, and nothing else: every
    member still RESTORED under a recovery id has the restored attempts N+1 retired (what it
    installed is freed and can never be continued) and is resumed. Members started closed
    stay closed (opening them would put an empty member into the fleet), members that do not
    answer are skipped (a RESTORED one reopens at its lease). Returns the members undone."""
    try:
        summary = await store_call(deadline, root.location, root.inspect, None)
    except PublicationError:
        return ()
    next_attempts = [
        e.next_attempt() for e in summary.manifest.continued if e.attempt < MAX_ATTEMPT
    ]
    credentials = spec.credentials()
    undone: list[str] = []

    async def undo(member: MemberSpec) -> None:
        async with spec.client(member, timeout=5.0, credentials=credentials) as client:
            try:
                status = await client.get_status()
                if status.state != RESTORED or not status.checkpoint_id.startswith(RECOVERY_PREFIX):
                    return
                if next_attempts:
                    await client.retire(status.checkpoint_id, deadline, next_attempts)
                await client.resume(status.checkpoint_id, deadline)
                undone.append(member.name)
            except ControlError as error:
                log.warning("undoing the recovery on %s failed (%s)", member.name, error)

    await asyncio.gather(*(undo(m) for m in spec.members))
    return tuple(sorted(undone))


async def open_fresh(
    fleet: Fleet, statuses: Mapping[str, pb.GetStatusResponse], control_id: str, deadline: float
) -> Recovery:
    """No checkpoint to restore: open every member started closed (their first Resume), in
    reverse stage order. `statuses` are the members' GetStatus replies.

    Nothing held by the other members is touched: a controller whose survivors hold
    episodes that the fresh member lost its part of (`collect`) retires them first."""
    closed = [m for m in fleet.members if awaiting_restore(statuses[m.name])]
    for _, members in reversed(fleet.stages()):
        waiting = [m for m in members if m in closed]
        if waiting:
            await fan_out(
                "resume",
                waiting,
                lambda m: m.client.resume(control_id, deadline),
                fleet.spec.fan_out,
            )
    return Recovery(control_id, None, (), (), opened=tuple(m.name for m in closed))


async def end_cut_checkpoints(
    fleet: Fleet, statuses: Mapping[str, pb.GetStatusResponse], control_id: str, deadline: float
) -> None:
    """Resume members still inside another checkpoint or restore (not `control_id`'s own,
    which a retry must replay, not end): Restore and Retire are refused until they are
    ended, and nothing else will end a checkpoint whose controller saw a member die."""
    cut = [
        m
        for m in fleet.members
        if statuses[m.name].state != IDLE and statuses[m.name].checkpoint_id != control_id
    ]
    if cut:
        log.info(
            "recovery %s: ending the checkpoints the crash cut on %s",
            control_id,
            ", ".join(m.name for m in cut),
        )
        await fan_out(
            "resume",
            cut,
            lambda m: m.client.resume(statuses[m.name].checkpoint_id, deadline),
            fleet.spec.fan_out,
        )


async def _live_episodes(fleet: Fleet) -> list[EpisodeId]:
    """Every episode any member holds now (before the rejoin retires them)."""
    pages = await fan_out(
        "list-episodes", fleet.members, lambda m: m.client.all_episodes(), fleet.spec.fan_out
    )
    return [
        EpisodeId(e.episode_id.rollout_id, e.episode_id.attempt)
        for episodes in pages.values()
        for e in episodes
    ]


def _highest_attempts(episodes: Iterable[EpisodeId]) -> tuple[EpisodeId, ...]:
    highest: dict[str, int] = {}
    for episode in episodes:
        highest[episode.rollout_id] = max(highest.get(episode.rollout_id, 0), episode.attempt)
    return tuple(sorted(EpisodeId(r, a) for r, a in highest.items()))
