"""Planted bug: the restore hook forgets a field the export writes.

`history` was added to the state after the restore hook was written: the export writes
`{count, history}`, the restore installs the count and starts `history` empty. Every tool
reply and the reward still match (they read the count only), so nothing looks wrong until the
state is read: after any restore (a replacement, a survivor's rejoin, `collect --resume`) the
session's history has lost every entry before the checkpoint, and its state (exported, and
reported by `/verify`) differs from the uninterrupted run's at `$.history[0]`
(`$.verify.history[0]` of the rollout).
"""

from __future__ import annotations

from typing import Any

from .honest import Counter, HonestCounter, valid_state


class DroppedFieldCounter(HonestCounter):
    async def restore_session_states(self, states: dict[str, Any]) -> None:
        checked = {sid: valid_state(sid, state) for sid, state in states.items()}
        for session_id, state in checked.items():
            self.counters[session_id] = Counter(state["count"])  # BUG: history is dropped
