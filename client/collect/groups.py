"""Prompt groups: the K rollouts of a task reach the output together, in one durable write.

A trainer such as GRPO learns from whole groups (the rewards of a task's K rollouts compared
with each other); a group the output holds in part is useless to it, and one assembled from
two runs' siblings may be wrong for it. Every rule below exists for a crash at the step
before it:

* **Sealed before written** (`GroupWriter.hold`): a finished sibling's line waits in the
  trainer ledger (`ResultLedger`, groups declared by `RolloutBook`; the rollout is
  `Status.HELD`) until every sibling of its group is finished or recorded failed; then the
  group's lines go out in ONE `DurableAppender.append`, so a crash, a power loss or a
  checkpoint sees none or all of a group.
* **Held results stay held until their group is durable**: a waiting sibling's receipt is
  not acknowledged, so the entry keeps its result in its outbox and every checkpoint carries
  it; a waiting sibling is not "finished" in the controller state (the output lacks it).
  After a crash, `--resume` takes it back from the outbox into its group
  (`receipts.HeldResults`), never into the output alone. Once the group's write is durable,
  all its receipts are acknowledged.
* **A crash that cut a sibling** (it was unfinished: it continues from a checkpoint or
  restarts) leaves its group to its policy (`--group-recovery`, or the task row's
  `group_recovery`), as the ledger decides it (`ResultLedger.cut`): `sibling` keeps the
  finished siblings; `group` discards every sibling not yet written and regenerates all of
  them from their inputs as later attempts, each retired everywhere first (the Retire
  releases the results the entry held of them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_checkpoint.client.collect.journal import DurableAppender, json_line
from rollout_checkpoint.client.collect.rollouts import Rollout, RolloutBook
from rollout_checkpoint.client.ledger import HeldOutcome
from rollout_checkpoint.v1 import participant_service_pb2 as pb


class GroupWriter:
    """Writes a prompt group once it is sealed (see the module doc)."""

    def __init__(self, book: RolloutBook, output: DurableAppender) -> None:
        self.book = book
        self.output = output

    async def hold(
        self, rollout: Rollout, line: dict[str, Any], receipt: pb.ResultReceipt | None = None
    ) -> bool:
        """Hand `rollout`'s outcome (`line`) to the ledger, and write its group if that
        sealed it. True once the group's write is durable (its receipts are owed now);
        False: nothing is written, nothing may be acknowledged."""
        group = self.book.held(rollout, line, receipt)
        if not group:
            return False
        write = asyncio.ensure_future(self._write(group))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # A recovery cancels the `/run`s it waits no longer for. Once the lines are
            # appended the book must say so before the caller ends: lines on disk with the
            # group still held would seal it never (a hang) or regenerate it (rows twice).
            await write
            raise
        return True

    async def _write(self, group: list[HeldOutcome]) -> None:
        await self.output.append(*(json_line(outcome.payload) for outcome in group))
        self.book.written(group)
