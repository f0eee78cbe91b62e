"""Planted bug: every increment is also appended to a file outside the process.

The file (`LEDGER_VARIABLE`, default `DEFAULT_LEDGER`) is an audit ledger, one JSON line
`{session, count}` for the seed's initial count and one per increment, and `/verify` grades the session by the ledger's total, not
by the count in memory. A restore rolls the in-memory count back to the checkpoint and the
restored episode re-issues the tool calls made after it, but nothing rolls the file back: each
such call is in the ledger twice, the verified count is too high and the reward differs from
the uninterrupted run's (`$.verify.count`). The exported state itself is correct.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from rollout_checkpoint.server.resources import tool

from .honest import HonestCounter, IncrementArgs

LEDGER_VARIABLE = "ROLLOUT_CHECKPOINT_FAULTY_LEDGER"
DEFAULT_LEDGER = "/tmp/rollout-checkpoint-faulty/ledger.jsonl"


def append_entry(ledger: Path, session_id: str, count: int) -> None:
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as file:
        file.write(json.dumps({"session": session_id, "count": count}) + "\n")


def ledger_total(ledger: Path, session_id: str) -> int:
    """The sum of the session's entries (0 before the first)."""
    try:
        lines = ledger.read_text().splitlines()
    except FileNotFoundError:
        return 0
    entries = (json.loads(line) for line in lines if line.strip())
    return sum(entry["count"] for entry in entries if entry.get("session") == session_id)


class SideEffectFileCounter(HonestCounter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = Path(os.environ.get(LEDGER_VARIABLE, DEFAULT_LEDGER))

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await super().seed_session(session_id, body)
        initial = self.counters[session_id].count
        await asyncio.to_thread(append_entry, self.ledger, session_id, initial)
        return reply

    @tool("Add `count` to the session's counter.")
    async def increment_counter(self, session_id: str, args: IncrementArgs) -> dict[str, Any]:
        reply: dict[str, Any] = await super().increment_counter(session_id, args)
        # BUG: an effect outside the process, which no restore rolls back.
        await asyncio.to_thread(append_entry, self.ledger, session_id, args.count)
        return reply

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        total = await asyncio.to_thread(ledger_total, self.ledger, session_id)
        expected = body.get("expected_count")
        return {"count": total, "reward": 1.0 if total == expected else 0.0}
