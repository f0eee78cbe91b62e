"""The Prepare stream: progress of a participant's drain, until ready, the deadline, or the end.

The stream is how a controller watches a fleet drain, so its messages are chosen to be few
and truthful:

* INITIAL at once, FINAL always last (PREPARED, or still PREPARING when the deadline passed,
  or whatever state a Resume left): a controller never has to guess how a stream ended.
* CHANGE only when the readiness report really differs, and coalesced (`COALESCE_SECONDS`):
  the control plane announces every change, including two per data-plane request, and a
  message per request would flood the controller during a busy drain.
* HEARTBEAT every `heartbeat_seconds` without a change: a controller tells a slow drain from
  a dead participant.
* A replayed Prepare (the id already reached PREPARED) gets its FINAL message at once.

The transition to PREPARED is made by the control plane under its lock; the stream only waits
for readiness outside it, so a Resume can always interrupt a Prepare.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_checkpoint.server.runtime.participant import ReadinessReport
from rollout_checkpoint.server.runtime.parts import ControlParts
from rollout_checkpoint.server.runtime.state_machine import ControlSettings, State
from rollout_checkpoint.server.runtime.waiting import first_of

COALESCE_SECONDS = 0.02


class UpdateKind(enum.StrEnum):
    INITIAL = "INITIAL"
    CHANGE = "CHANGE"
    HEARTBEAT = "HEARTBEAT"
    FINAL = "FINAL"


@dataclass(frozen=True, slots=True)
class PrepareUpdate:
    state: State
    checkpoint_id: str
    report: ReadinessReport
    lease_expires_at: float | None
    sequence: int
    elapsed: float
    kind: UpdateKind
    replayed: bool
    admission_open: bool

    @property
    def final(self) -> bool:
        return self.kind is UpdateKind.FINAL


class PrepareHost(ControlParts, Protocol):
    """What the stream reads of the control plane, and the one transition it asks for."""

    @property
    def settings(self) -> ControlSettings: ...

    @property
    def state(self) -> State: ...

    @property
    def active_checkpoint_id(self) -> str | None: ...

    @property
    def lease_expires_at(self) -> float | None: ...

    @property
    def admission_open(self) -> bool: ...

    def change_event(self) -> asyncio.Event:
        """The event the next change (of readiness, state or admission) sets."""
        ...

    async def mark_prepared(self, checkpoint_id: str) -> None:
        """PREPARING -> PREPARED, under the lock, if still preparing this id and ready."""
        ...


async def prepare_updates(
    host: PrepareHost, checkpoint_id: str, deadline: float, started: float, replayed: bool
) -> AsyncIterator[PrepareUpdate]:
    """The messages of one Prepare stream (the transition to PREPARING is already made)."""
    clock = host.clock
    participant = host.participant
    sequence = 0

    def update(kind: UpdateKind, report: ReadinessReport | None = None) -> PrepareUpdate:
        nonlocal sequence
        sequence += 1
        return PrepareUpdate(
            state=host.state,
            checkpoint_id=host.active_checkpoint_id or "",
            report=report or participant.report(),
            lease_expires_at=host.lease_expires_at,
            sequence=sequence,
            elapsed=max(0.0, clock.now() - started),
            kind=kind,
            replayed=replayed,
            admission_open=host.admission_open,
        )

    if replayed:
        yield update(UpdateKind.FINAL)
        return
    loop = asyncio.get_running_loop()
    last = update(UpdateKind.INITIAL)
    yield last
    last_sent_at = loop.time()
    heartbeat_seconds = host.settings.heartbeat_seconds
    next_heartbeat = clock.now() + heartbeat_seconds
    change_pending = False
    while True:
        wake = host.change_event()
        if host.active_checkpoint_id != checkpoint_id or host.state is not State.PREPARING:
            break
        if participant.ready():
            await host.mark_prepared(checkpoint_id)
            continue
        now = clock.now()
        if now >= deadline:
            break
        if change_pending and loop.time() - last_sent_at >= COALESCE_SECONDS:
            change_pending = False
            report = participant.report()
            if _report_differs(report, last.report):
                last = update(UpdateKind.CHANGE, report)
                last_sent_at = loop.time()
                yield last
                continue
        if now >= next_heartbeat:
            last = update(UpdateKind.HEARTBEAT)
            last_sent_at = loop.time()
            next_heartbeat = now + heartbeat_seconds
            yield last
            continue
        waits: list[Awaitable[Any]] = [
            wake.wait(),
            clock.sleep_until(min(deadline, next_heartbeat)),
        ]
        if change_pending:
            waits.append(asyncio.sleep(COALESCE_SECONDS - (loop.time() - last_sent_at)))
        if await first_of(waits) == 0:
            change_pending = True
    ended_in = host.state if host.active_checkpoint_id == checkpoint_id else State.IDLE
    host.observer.prepare_ended(ended_in.value)
    yield update(UpdateKind.FINAL)


def _report_differs(a: ReadinessReport, b: ReadinessReport) -> bool:
    return (a.ready, a.blocker_count, a.blockers, dict(a.counts)) != (
        b.ready,
        b.blocker_count,
        b.blockers,
        dict(b.counts),
    )
