"""The coordinator's discovered fleet, shared by every RPC that is running.

A fleet is discovered once and its channels are shared, because discovering a fleet of a
thousand members costs a thousand calls. It is discovered again when an operator asks
(ListParticipants: a member may have been replaced behind the same address) or after a call
failed on the transport. The rule that keeps that safe: rediscovery never closes channels an
RPC in progress still uses. Before, a ListParticipants during a Checkpoint closed the
channels the checkpoint was committing through, and the checkpoint failed with "Channel is
closed" though every member was healthy. So forgetting a fleet only detaches it: the next
RPC discovers afresh, and the old fleet's channels close when the last RPC holding it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from rollout_checkpoint.client.fleet import Fleet


@dataclass
class _Holding:
    fleet: Fleet
    holders: int = 0
    forgotten: bool = False


class HeldFleets:
    """`held()` lends the current fleet to one RPC for as long as it runs; `forget()`
    makes the next RPC discover afresh; `close()` (the coordinator's stop) forgets too."""

    def __init__(self, discover: Callable[[], Awaitable[Fleet]]) -> None:
        self._discover = discover
        self._current: _Holding | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[Fleet]:
        async with self._lock:
            if self._current is None:
                self._current = _Holding(await self._discover())
            holding = self._current
            holding.holders += 1
        try:
            yield holding.fleet
        finally:
            await self._release(holding)

    async def forget(self) -> None:
        async with self._lock:
            holding, self._current = self._current, None
            if holding is None:
                return
            holding.forgotten = True
            idle = holding.holders == 0
        if idle:
            await holding.fleet.close()

    async def close(self) -> None:
        await self.forget()

    async def _release(self, holding: _Holding) -> None:
        async with self._lock:
            holding.holders -= 1
            last = holding.forgotten and holding.holders == 0
        if last:
            await holding.fleet.close()
