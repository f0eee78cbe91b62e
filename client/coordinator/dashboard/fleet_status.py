"""The fleet now, for the dashboard (`GET /fleet/status`): each member's health (does its
sidecar answer, and how), its state, admission and prepare readiness.

Why not `GET /fleet` (ListParticipants): that only lists the members. Here every member is
asked its status on its own and one that cannot be asked is a row saying why, like
`rollout-checkpoint status`, because the member that is down is the one row an operator
opened the page to see.

Why the coordinator's own held fleet (`HeldFleets.held`) and only GetStatus: kind and
instance are already known from discovery, and the held fleet's channels are already open.
Before, every round opened a new channel per member and asked GetParticipant and GetStatus
on each: for a fleet of 1,000 members that was 1,000 channels and 2,000 RPCs every 1.5 s on
the coordinator's loop, stalling it 120-300 ms and making a checkpoint's pause about 1.5x
longer while a page was open.

Why the answer is shared for `fresh_seconds`: every open page polls, so the members are
asked at most once per `fresh_seconds` (`PARALLEL` at a time) whatever the number of pages,
and that interval grows with the fleet (`MEMBERS_PER_SECOND`) so a large fleet costs the
same share of the loop as a small one.

Why no asking during a checkpoint or restore of this coordinator: those RPCs are the ones
whose pause an operator is waiting on, and the sidecars and the loop they run through are
the ones a probe would slow. The last answer is served then, marked `stale`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, Member
from rollout_checkpoint.client.participant import state_name

FRESH_SECONDS = 1.5
"""The shortest time one round of answers serves every page (the page polls every 2 s)."""
MEMBERS_PER_SECOND = 500.0
"""A round is asked again no sooner than members / `MEMBERS_PER_SECOND` seconds."""
PROBE_SECONDS = 3.0
"""How long a member may take to answer before it is reported unreachable."""
PARALLEL = 64
"""Members asked at once."""

HeldFleet = Callable[[], AbstractAsyncContextManager[Fleet]]
"""Lends the coordinator's discovered fleet (`HeldFleets.held`)."""


class FleetStatus:
    """The members' status, asked again through the coordinator's held fleet when the last
    answer is older than `fresh_seconds` and no checkpoint or restore is running."""

    def __init__(self, spec: FleetSpec, held: HeldFleet, operating: Callable[[], bool]) -> None:
        self.spec = spec
        self.fresh_seconds = max(FRESH_SECONDS, len(spec.members) / MEMBERS_PER_SECOND)
        self._held = held
        self._operating = operating
        self._asking = asyncio.Lock()
        self._answered_at = -math.inf
        self._answer: dict[str, Any] = {"members": []}

    async def read(self) -> dict[str, Any]:
        """`{"members": [...], "stale": bool}` in the fleet file's order."""
        async with self._asking:
            if self._operating():
                return {**self._answer, "stale": True}
            if time.monotonic() - self._answered_at >= self.fresh_seconds:
                self._answer = {"members": await self._ask_everyone(), "stale": False}
                self._answered_at = time.monotonic()
            return self._answer

    async def _ask_everyone(self) -> list[dict[str, Any]]:
        try:
            async with self._held() as fleet:
                limit = asyncio.Semaphore(PARALLEL)
                rows = await asyncio.gather(*(_ask(member, limit) for member in fleet.members))
        except FleetError as error:
            return [_undiscovered(m.name, m.address, error) for m in self.spec.members]
        by_name = {row["name"]: row for row in rows}
        return [by_name[m.name] for m in self.spec.members if m.name in by_name]


async def _ask(member: Member, limit: asyncio.Semaphore) -> dict[str, Any]:
    """One member's row; a member that cannot be asked is a row saying why."""
    row: dict[str, Any] = {
        "name": member.name,
        "address": member.address,
        "kind": member.kind_name,
        "instance": member.instance,
    }
    async with limit:
        try:
            status = await asyncio.wait_for(member.client.get_status(), PROBE_SECONDS)
        except ControlError as error:
            row["health"] = "refused" if error.decided_by_server else "unreachable"
            row["error"] = f"{error.code.name}: {error.message}"
            return row
        except TimeoutError:
            row.update(health="unreachable", error=f"no answer within {PROBE_SECONDS:g} s")
            return row
    row.update(
        health="serving",
        state=state_name(status.state, "?"),
        admission="open" if status.admission_open else "closed",
        ready=status.readiness.ready,
        blockers=status.readiness.blocker_count,
    )
    return row


def _undiscovered(name: str, address: str, error: FleetError) -> dict[str, Any]:
    """A member's row when the fleet could not be discovered: the members that failed say
    why; the others answered discovery but were not asked their status."""
    failure = error.failures.get(name)
    if failure is None:
        return {
            "name": name,
            "address": address,
            "health": "unknown",
            "error": "not asked: the fleet could not be discovered",
        }
    return {
        "name": name,
        "address": address,
        "health": "refused" if failure.decided_by_server else "unreachable",
        "error": f"{failure.code.name}: {failure.message}",
    }
