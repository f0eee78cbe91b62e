"""An injected clock whose sleepers a test can see.

After `clock.set(t)`, "the lease has not expired" cannot be checked by looking once after a
loop turn: the woken timer may simply not have run yet. With `ObservedClock`, a test waits for
a state reached by an event instead: every sleeper the move woke has run on, and a timer is
asleep until a given time (the lease watcher back asleep until the lease). A timer asleep
until a time still ahead has not fired, by construction.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from rollout_checkpoint.server.core.clock import ManualClock

SETTLE_SECONDS = 30.0
"""Bound on waiting for the sleepers (a safety net: woken sleepers run within a loop turn)."""


class ObservedClock(ManualClock):
    """A ManualClock that counts its sleepers by the time they sleep until."""

    def __init__(self, start: float | None = None) -> None:
        super().__init__(start)
        self._asleep: Counter[float] = Counter()
        self._changed = asyncio.Event()

    async def sleep_until(self, when: float) -> None:
        self._asleep[when] += 1
        self._changed.set()
        try:
            await super().sleep_until(when)
        finally:  # woken (or cancelled) and running again
            self._asleep[when] -= 1
            if not self._asleep[when]:
                del self._asleep[when]
            self._changed.set()

    def asleep(self) -> list[float]:
        """The times sleepers sleep until, one entry per sleeper, earliest first; a time that
        is not ahead belongs to a sleeper that was woken and has not run yet."""
        return sorted(self._asleep.elements())

    async def settled(
        self,
        check: Callable[[list[float]], bool] = lambda asleep: True,
        what: str = "the sleepers settled",
        timeout: float = SETTLE_SECONDS,
    ) -> None:
        """Return once every sleeper woken so far has run on and `check(self.asleep())`
        holds."""
        try:
            async with asyncio.timeout(timeout):
                while any(t <= self.now() for t in self._asleep) or not check(self.asleep()):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"not {what} within {timeout} s (now {self.now()}, asleep until {self.asleep()})"
            ) from None

    async def sleeping_until(self, when: float, timeout: float = SETTLE_SECONDS) -> None:
        """Return once every sleeper woken so far has run on and one is asleep until `when`
        (a time ahead of now)."""
        assert when > self.now(), f"{when} is not ahead of the clock ({self.now()})"
        await self.settled(lambda asleep: when in asleep, f"a sleeper asleep until {when}", timeout)
