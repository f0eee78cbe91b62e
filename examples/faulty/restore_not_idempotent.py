"""Planted bug: the restore hook adds the stored count to what the session holds.

Its author keeps a retired session's counter in the process (the retire only marks it
closed), which alone costs memory, nothing more, and wrote the restore as "add what the
checkpoint says" instead of "set it". In a fresh replacement the two agree. In a process that
held the session, a survivor taking a rejoining Restore after another member died, or after
`collect --resume`, or a Restore retried after a failed one, the count is the checkpoint's
plus what the session held: its state (exported, and reported by `/verify`) differs at
`$.count` (`$.verify.count` of the rollout).
"""

from __future__ import annotations

from typing import Any

from .honest import Counter, HonestCounter, valid_state


class RestoreNotIdempotentCounter(HonestCounter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closed: set[str] = set()

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        checked = {sid: valid_state(sid, state) for sid, state in states.items()}
        for session_id, state in checked.items():
            held = self.counters.get(session_id, Counter(0))
            # BUG: adds instead of setting; `held` is not empty in a process that had it.
            self.counters[session_id] = Counter(held.count + state["count"], state["history"])
            self.closed.discard(session_id)

    async def retire_session_state(self, session_id: str) -> None:
        self.closed.add(session_id)  # kept: the count outlives the session in this process
