"""HeldFleets: a forgotten fleet's channels close once, when the last RPC holding it ends."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from rollout_checkpoint.client.coordinator.held_fleets import HeldFleets
from rollout_checkpoint.client.fleet import Fleet


class CountingFleet:
    """Only what HeldFleets touches of a Fleet: `close`."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


async def test_a_forgotten_fleet_closes_when_its_last_holder_ends() -> None:
    made: list[CountingFleet] = []

    async def discover() -> Fleet:
        made.append(CountingFleet(len(made)))
        return cast(Fleet, made[-1])

    fleets = HeldFleets(discover)
    holding = asyncio.Event()
    done = asyncio.Event()

    async def long_rpc() -> Any:
        async with fleets.held() as fleet:
            holding.set()
            await done.wait()
            return fleet

    rpc = asyncio.create_task(long_rpc())
    await holding.wait()
    await fleets.forget()
    assert made[0].closed == 0  # the running RPC still uses its channels
    async with fleets.held() as fresh:
        assert fresh is cast(Fleet, made[1])  # a new RPC discovers afresh
    done.set()
    assert await rpc is cast(Fleet, made[0])
    assert [f.closed for f in made] == [1, 0]
    await fleets.close()
    assert [f.closed for f in made] == [1, 1]
    await fleets.close()
    assert [f.closed for f in made] == [1, 1]
