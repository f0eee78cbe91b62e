"""The counter example: the smallest `exported` resources server.

`/seed_session {initial_count}`, `/increment_counter {count}`, `/get_counter_value`,
`/verify {expected_count}` (reward 1.0 iff equal). Its checkpoint state is `{count: int}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, StrictInt

from rollout_checkpoint.server.resources import (
    CheckpointMode,
    InvalidSessionState,
    ResourcesServer,
    tool,
)


class IncrementArgs(BaseModel):
    count: StrictInt = 1


class NoArgs(BaseModel):
    pass


class CounterServer(ResourcesServer):
    """Incremental (`checkpoint_incremental`): a counter changes only in `/seed_session`,
    `/increment_counter`, `/verify` (it reads) and `/close_session`, each a request on its
    session, and no task runs beside them; so a checkpoint that writes only the sessions
    those touched, and references the others' earlier records, restores exactly the
    counters a full one would."""

    checkpoint_mode = CheckpointMode.EXPORTED
    checkpoint_incremental = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counters: dict[str, int] = {}

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        initial = body.get("initial_count", 0)
        if type(initial) is not int:
            initial = 0
        self.counters.setdefault(session_id, initial)
        return {}

    @tool("Add `count` to the session's counter.")
    async def increment_counter(self, session_id: str, args: IncrementArgs) -> dict[str, Any]:
        self.counters[session_id] = self.counters.get(session_id, 0) + args.count
        return {"success": True}

    @tool("Read the session's counter.")
    async def get_counter_value(self, session_id: str, args: NoArgs) -> dict[str, Any]:
        return {"count": self.counters.get(session_id, 0)}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        count = self.counters.get(session_id)
        expected = body.get("expected_count")
        return {"reward": 1.0 if count is not None and count == expected else 0.0, "count": count}

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        return {sid: {"count": self.counters[sid]} for sid in session_ids if sid in self.counters}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        # Validate every state before installing any: never a partial set.
        for session_id, state in states.items():
            if (
                not isinstance(state, dict)
                or set(state) != {"count"}
                or type(state["count"]) is not int
            ):
                raise InvalidSessionState(session_id, "a counter state is exactly {count: int}")
        for session_id, state in states.items():
            self.counters[session_id] = state["count"]

    async def retire_session_state(self, session_id: str) -> None:
        self.counters.pop(session_id, None)
