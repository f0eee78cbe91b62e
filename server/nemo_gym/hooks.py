"""Ready session hooks for the two NeMo Gym 0.4.0 servers we checkpoint, and their verify modes.

- `indirect_prompt_injection` (`IPIResourcesServer.session_id_to_env`): one JSON environment
  per session, `EnvironmentStates` (schema version 1, copied through JSON, validated in full
  before any install). Its `/verify` pops the environment, so it cannot run twice: `wait`.
- `example_session_state_mgmt` (`StatefulCounterResourcesServer.session_id_to_counter`): one
  int per session, `CounterStates`. Its `/verify` only reads: `replay`.

A NeMo Gym user's own server passes its own `SessionHooks` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from rollout_checkpoint.server.resources.json_state import SCHEMA_VERSION, EnvironmentStates
from rollout_checkpoint.server.resources.participant import (
    InvalidSessionState,
    SessionHooks,
    VerifyMode,
)

__all__ = ["CounterStates", "ready_hooks"]


class CounterStates:
    """The session hooks over a `{session_id: int}` dict, mutated in place.

    State: exactly `{"schema_version": 1, "count": <int>}` (a bool is no count: JSON `true`
    must not restore as 1). Every state is validated before any is installed."""

    def __init__(self, counters: MutableMapping[str, int]) -> None:
        self.counters = counters

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        """The count of every id still held; ids not held are left out."""
        return {
            session_id: {"schema_version": SCHEMA_VERSION, "count": self.counters[session_id]}
            for session_id in session_ids
            if session_id in self.counters
        }

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Install every count, or none (`InvalidSessionState` naming the first bad one)."""
        counts: dict[str, int] = {}
        for session_id, state in states.items():
            if (
                not isinstance(state, dict)
                or set(state) != {"schema_version", "count"}
                or type(state["schema_version"]) is not int
                or state["schema_version"] != SCHEMA_VERSION
                or type(state["count"]) is not int
            ):
                raise InvalidSessionState(
                    session_id,
                    f"session {session_id}: a counter state is exactly "
                    f'{{"schema_version": 1, "count": <int>}}, not {state!r:.200}',
                )
            counts[session_id] = state["count"]
        self.counters.update(counts)

    async def retire_session_state(self, session_id: str) -> None:
        """Drop the session's count; nothing for an id not held."""
        self.counters.pop(session_id, None)


def ready_hooks(server: Any) -> tuple[SessionHooks, VerifyMode] | None:
    """The shipped hooks and verify mode for `server` (a NeMo Gym server instance), by its
    class name; None for a server we ship none for (then pass your own)."""
    name = type(server).__name__
    if name == "IPIResourcesServer":
        return EnvironmentStates(server.session_id_to_env), VerifyMode.WAIT
    if name == "StatefulCounterResourcesServer":
        return CounterStates(server.session_id_to_counter), VerifyMode.REPLAY
    return None
