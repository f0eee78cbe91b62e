"""The fleet now, for the dashboard (`GET /fleet/status`): each member's health (does its
sidecar answer, and how), its state, admission and prepare readiness.

Why not `GET /fleet` (ListParticipants): that discovers the whole fleet and fails whole when
one member is down, while the member that is down is the one row an operator opened the page
to see. Here every member is asked on its own and one that cannot be asked is a row saying
why, like `rollout-checkpoint status`.

Why the answer is shared for `FRESH_SECONDS`: every open page polls, and a fleet of 1,000
members asked once per page and poll would be thousands of RPCs a second against the very
sidecars a checkpoint needs; so the members are asked at most once per `FRESH_SECONDS`
(`PARALLEL` at a time), whatever the number of pages, and the pages share the answer.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import grpc

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import KIND_NAMES, FleetSpec, MemberSpec
from rollout_checkpoint.v1 import types_pb2

FRESH_SECONDS = 1.5
"""How long one round of answers serves every page (the page polls every 2 s)."""
PROBE_SECONDS = 3.0
"""How long a member may take to answer before it is reported unreachable."""
PARALLEL = 64
"""Members asked at once."""
_STATE_PREFIX = "PARTICIPANT_STATE_"


class FleetStatus:
    """The members' status, asked again when the last answer is older than `FRESH_SECONDS`."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self._asking = asyncio.Lock()
        self._answered_at = -math.inf
        self._answer: dict[str, Any] = {"members": []}
        self._credentials: grpc.ChannelCredentials | None = None
        self._credentials_read = False

    async def read(self) -> dict[str, Any]:
        """`{"members": [...]}` in the fleet file's order."""
        async with self._asking:
            if time.monotonic() - self._answered_at >= FRESH_SECONDS:
                self._answer = await self._ask_everyone()
                self._answered_at = time.monotonic()
            return self._answer

    async def _ask_everyone(self) -> dict[str, Any]:
        if not self._credentials_read:  # TLS files: read once, off the loop
            self._credentials = await asyncio.to_thread(self.spec.credentials)
            self._credentials_read = True
        limit = asyncio.Semaphore(PARALLEL)
        rows = await asyncio.gather(*(self._ask(member, limit) for member in self.spec.members))
        return {"members": rows}

    async def _ask(self, member: MemberSpec, limit: asyncio.Semaphore) -> dict[str, Any]:
        """One member's row; a member that cannot be asked is a row saying why."""
        row: dict[str, Any] = {"name": member.name, "address": member.address}
        client = self.spec.client(member, timeout=PROBE_SECONDS, credentials=self._credentials)
        async with limit, client:
            try:
                described, status = await asyncio.gather(
                    client.get_participant(), client.get_status()
                )
            except ControlError as error:
                row["health"] = "refused" if error.decided_by_server else "unreachable"
                row["error"] = f"{error.code.name}: {error.message}"
                return row
        row.update(
            health="serving",
            kind=KIND_NAMES.get(described.kind, "?"),
            instance=described.instance,
            state=_state_name(status.state),
            admission="open" if status.admission_open else "closed",
            ready=status.readiness.ready,
            blockers=status.readiness.blocker_count,
        )
        return row


def _state_name(state: int) -> str:
    try:
        return types_pb2.ParticipantState.Name(state).removeprefix(_STATE_PREFIX)  # type: ignore[arg-type]
    except ValueError:
        return "?"
