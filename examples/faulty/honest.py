"""The counter the faulty servers start from: correct, with a `history` beside the count.

A session's state is `{count, history}`: `history` is the count after each increment, in
order. The seed reads `initial_count` from the task's `environment` (what the example agent
sends as the seed body). Every faulty server overrides exactly one thing of this class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_checkpoint.server.resources import (
    CheckpointMode,
    InvalidSessionState,
    ResourcesServer,
    tool,
)

from ..counter import IncrementArgs, NoArgs

__all__ = ["Counter", "HonestCounter", "IncrementArgs", "NoArgs", "initial_count", "valid_state"]


@dataclass
class Counter:
    """One session's counter."""

    count: int
    history: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "history": list(self.history)}


def initial_count(body: Mapping[str, Any]) -> int:
    """The seed's `environment.initial_count` (0 when absent or not an integer)."""
    environment = body.get("environment")
    initial = environment.get("initial_count", 0) if isinstance(environment, Mapping) else 0
    return initial if type(initial) is int else 0


def valid_state(session_id: str, state: object) -> dict[str, Any]:
    """A stored `{count: int, history: [int]}`, or `InvalidSessionState`."""
    if (
        not isinstance(state, dict)
        or set(state) != {"count", "history"}
        or type(state["count"]) is not int
        or not isinstance(state["history"], list)
        or any(type(entry) is not int for entry in state["history"])
    ):
        raise InvalidSessionState(session_id, "a counter state is {count: int, history: [int]}")
    return state


class HonestCounter(ResourcesServer):
    """`/seed_session`, `increment_counter {count}`, `get_counter_value`, `/verify
    {expected_count}` (reward 1.0 iff equal).

    An increment answers `{"success": true}`, not the count: the tasks' plans only increment,
    so a planted bug that corrupts the count or the history changes no reply the policy model
    reads, every restored episode asks the model what the baseline asked (the replayed model
    answers it), and the bug shows where it lives, in the exported state or the verification,
    instead of as a model call the baseline never made.

    The verification reports the session's whole state beside the reward, as a grader
    that shows its work does: the verify reply is part of every rollout's output, so a
    state the bug changed shows there at its field too, beside the exported state."""

    checkpoint_mode = CheckpointMode.EXPORTED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counters: dict[str, Counter] = {}

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self.counters.setdefault(session_id, Counter(initial_count(body)))
        return {}

    @tool("Add `count` to the session's counter.")
    async def increment_counter(self, session_id: str, args: IncrementArgs) -> dict[str, Any]:
        counter = self.counters.setdefault(session_id, Counter(0))
        counter.count += args.count
        counter.history.append(counter.count)
        return {"success": True}

    @tool("Read the session's counter.")
    async def get_counter_value(self, session_id: str, args: NoArgs) -> dict[str, Any]:
        counter = self.counters.get(session_id)
        return {"count": counter.count if counter is not None else 0}

    def state_of(self, session_id: str) -> dict[str, Any]:
        """The session's state as its export writes it and its verification reports it."""
        return self.counters[session_id].to_json()

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if session_id not in self.counters:
            return {"count": None, "reward": 0.0}
        state = self.state_of(session_id)
        return {**state, "reward": 1.0 if state["count"] == body.get("expected_count") else 0.0}

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        return {sid: self.state_of(sid) for sid in session_ids if sid in self.counters}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        # Validate every state before installing any: never a partial set.
        checked = {sid: valid_state(sid, state) for sid, state in states.items()}
        for session_id, state in checked.items():
            self.counters[session_id] = Counter(state["count"], list(state["history"]))

    async def retire_session_state(self, session_id: str) -> None:
        self.counters.pop(session_id, None)
