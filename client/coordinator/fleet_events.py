"""The coordinator's fleet events: numbered, kept for late readers, fanned out to watchers.

`WatchFleet` readers reconnect: a trainer that lost its stream for a second must not miss the
`recovery_finished` that tells it which rollouts to re-send. So every event gets a sequence
number and the newest `KEPT_EVENTS` are kept for replay. A reader that falls further behind
than that is cut off (it would otherwise hold an unbounded queue in the coordinator) and
reconnects from the last sequence it saw.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from rollout_checkpoint.client.fleet.membership import Change, MemberEvent
from rollout_checkpoint.server.core.rpc.wire import timestamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

KEPT_EVENTS = 1024


class WatcherTooSlow(Exception):
    """The reader fell more than `KEPT_EVENTS` events behind and was cut off."""


class FleetEventLog:
    """Events of one coordinator process, in order (`coordinator_boot_id` names the process)."""

    def __init__(self, *, kept: int = KEPT_EVENTS) -> None:
        self.boot_id = secrets.token_hex(8)
        self._kept: deque[cpb.FleetEvent] = deque(maxlen=kept)
        self._sequence = 0
        self._readers: set[_Reader] = set()
        self._closed = False

    @property
    def last_sequence(self) -> int:
        return self._sequence

    def emit(self, **event: Any) -> cpb.FleetEvent:
        """Append one event (`member_up=cpb.MemberChange(...)`, ...) and hand it to every
        reader."""
        self._sequence += 1
        message = cpb.FleetEvent(
            sequence=self._sequence,
            time=timestamp(time.time()),
            coordinator_boot_id=self.boot_id,
            **event,
        )
        self._kept.append(message)
        for reader in list(self._readers):
            reader.offer(message)
        return message

    def member_changed(self, event: MemberEvent) -> None:
        """Emit a member's change (`membership.FleetWatch`'s report) as its event."""
        member = cpb.Member(
            name=event.name,
            address=event.address,
            kind=event.kind,
            instance=event.instance,
            boot_id=event.boot_id,
        )
        change = cpb.MemberChange(
            member=member, previous_boot_id=event.previous_boot_id, detail=event.detail
        )
        field = {Change.UP: "member_up", Change.DOWN: "member_down"}.get(
            event.change, "member_replaced"
        )
        self.emit(**{field: change})

    def held(self) -> list[cpb.FleetEvent]:
        """The events still kept, oldest first."""
        return list(self._kept)

    def close(self) -> None:
        """End every reader's stream (the coordinator stops)."""
        self._closed = True
        for reader in list(self._readers):
            reader.offer(None)

    async def read(
        self, after_sequence: int = 0, *, live_only: bool = False
    ) -> AsyncIterator[cpb.FleetEvent]:
        """The held events above `after_sequence` (none with `live_only`), then each new one,
        until `close`. Raises `WatcherTooSlow` when the reader falls too far behind."""
        reader = _Reader(self._kept.maxlen or KEPT_EVENTS)
        self._readers.add(reader)
        try:
            if not live_only:
                for message in list(self._kept):
                    if message.sequence > after_sequence:
                        yield message
                        after_sequence = message.sequence
            while not self._closed:
                live = await reader.next()
                if live is None:
                    return
                if live.sequence > after_sequence:
                    yield live
        finally:
            self._readers.discard(reader)


class _Reader:
    def __init__(self, limit: int) -> None:
        self._queue: asyncio.Queue[cpb.FleetEvent | None] = asyncio.Queue()
        self._limit = limit
        self._overflowed = False

    def offer(self, message: cpb.FleetEvent | None) -> None:
        if self._queue.qsize() >= self._limit and message is not None:
            self._overflowed = True
            return
        self._queue.put_nowait(message)

    async def next(self) -> cpb.FleetEvent | None:
        if self._overflowed and self._queue.empty():
            raise WatcherTooSlow(f"the reader fell more than {self._limit} events behind")
        message = await self._queue.get()
        return message
