"""Planted bug: a background task the runtime never sees changes session state.

Every session counts `idle_ticks`, incremented by a task of the process every `TICK_SECONDS`
while the session exists. The runtime admits, counts and drains requests, but this task is
none: it changes state during a checkpoint, after the export took its snapshot, and its
ticks between a checkpoint and a crash are lost by a restore. Its exported state depends on
the wall clock: two uninterrupted runs at different concurrencies differ at `$.idle_ticks` (and
the verify reply, which reports the state, at `$.verify.idle_ticks`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_checkpoint.server.resources import InvalidSessionState

from .honest import HonestCounter

TICK_SECONDS = 0.01


class BackgroundMutationCounter(HonestCounter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_ticks: dict[str, int] = {}
        self.ticker: asyncio.Task[None] | None = None

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self.idle_ticks.setdefault(session_id, 0)
        self._start_ticker()
        return await super().seed_session(session_id, body)

    def _start_ticker(self) -> None:
        """Started by the first seed (or restore): the app's event loop runs by then."""
        if self.ticker is None:
            self.ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            for session_id in self.counters:
                # BUG: session state changed outside any request the runtime admits.
                self.idle_ticks[session_id] = self.idle_ticks.get(session_id, 0) + 1

    def state_of(self, session_id: str) -> dict[str, Any]:
        return {**super().state_of(session_id), "idle_ticks": self.idle_ticks.get(session_id, 0)}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        for session_id, state in states.items():
            if not isinstance(state, dict) or type(state.get("idle_ticks")) is not int:
                raise InvalidSessionState(session_id, "a state carries idle_ticks: int")
        await super().restore_session_states(
            {
                sid: {k: v for k, v in state.items() if k != "idle_ticks"}
                for sid, state in states.items()
            }
        )
        for session_id, state in states.items():
            self.idle_ticks[session_id] = state["idle_ticks"]
        self._start_ticker()

    async def retire_session_state(self, session_id: str) -> None:
        self.idle_ticks.pop(session_id, None)
        await super().retire_session_state(session_id)
