"""Time for leases, heartbeats and thresholds, injectable so tests never sleep.

Deadlines and leases are absolute wall-clock times (seconds since the epoch), because the
controller that sets them lives in another process. Every wait on such a time goes through the
clock, so a test can move time forward and see a lease expire at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds since the epoch."""
        ...

    async def sleep_until(self, when: float) -> None:
        """Return once `now() >= when`."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.time()

    async def sleep_until(self, when: float) -> None:
        # Re-check after waking: the wall clock may have been stepped while we slept.
        while (remaining := when - time.time()) > 0:  # noqa: ASYNC110 - sleeping is the point
            await asyncio.sleep(remaining)


class ManualClock:
    """A clock that moves only when told to; sleepers wake as `advance` passes their time.

    It starts at the real time, to the next whole second (unless told otherwise): code under
    test that reads the wall clock as well (a storage call bounded by `time.time()`) sees a
    deadline taken from this clock as the same moment, on any day the tests run, not only
    before a fixed date."""

    def __init__(self, start: float | None = None) -> None:
        # A whole second: protobuf timestamps a test compares with it keep no fraction.
        self._now = float(int(time.time()) + 1) if start is None else start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep_until(self, when: float) -> None:
        if when <= self._now:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (when, next(self._order), future))
        await future

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose time has come."""
        self.set(self._now + seconds)

    def set(self, when: float) -> None:
        self._now = max(self._now, when)
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)
