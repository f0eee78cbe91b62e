"""Background part writes: the second half of an asynchronous commit.

An asynchronous Commit answers once its export is serialized into a snapshot (immutable
bytes); the write, fsync or upload and the manifest happen here, while admission may already
be open again. The rules each prevent a loss:

* The snapshot is bytes, not the exported records: the data plane runs again during the
  write, and a live object it mutated would store state from after the cut.
* At most one write runs per participant (`idle` lets the next Commit wait before it
  exports): two snapshots held at once would double the memory a checkpoint costs, and a
  controller that commits faster than storage writes would grow it without bound.
* The write goes through the same `CheckpointStorage.write_part` as a synchronous commit
  (records first, a manifest created without replacing one), so a crash at any moment leaves
  nothing or a complete part, and a part once published is never replaced.
* A Resume does not stop it: the point of the mode is that the fleet runs on while storage
  works. Its outcome (durable with the manifest, or failed with a typed reason) is kept for
  the last `OUTCOMES_KEPT` ids, so a controller that lost a reply (or a new controller)
  still learns it; one that died leaves a write that simply ends, and a part no fleet
  manifest names is never restored.
* Closing the participant stops a write that has not begun publishing (its fence): a
  process shutting down abandons the part cleanly instead of racing its own exit.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_checkpoint.server.core.daemon_threads import run_in_daemon_thread
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.layout import PartRecords
from rollout_checkpoint.server.core.part_storage import (
    CheckpointStorage,
    PublishedPart,
    StopRequested,
    WriteFence,
)
from rollout_checkpoint.server.runtime.part_chain import PartPlan
from rollout_checkpoint.server.runtime.waiting import retrieve_exception

log = logging.getLogger(__name__)

OUTCOMES_KEPT = 64


class PartWriteState(enum.StrEnum):
    UNKNOWN = "UNKNOWN"
    WRITING = "WRITING"
    DURABLE = "DURABLE"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class PartSnapshot:
    """An asynchronous commit's export, serialized: what the background write stores.

    `plan`: an incremental part, whose `lines` are its own records only; the write composes
    the part from them in its thread (`PartPlan.write`: reference lines, digests, the chain).
    `settled` is told how the write ended: the part once durable (it becomes the base of the
    next incremental part then, never before: a write that fails must leave its records
    changed), or None."""

    lines: tuple[bytes, ...]
    plan: PartPlan | None = None
    settled: Callable[[PublishedPart | None], None] | None = None

    @property
    def size(self) -> int:
        """The bytes the snapshot holds: an incremental part's own records (its reference
        lines are composed by the write)."""
        return sum(len(line) + 1 for line in self.lines)

    @property
    def records(self) -> PartRecords:
        """What the durable part will hold, known at the cut: its own records are the
        snapshot's lines, every other record of the plan a reference."""
        written = len(self.lines)
        if self.plan is None:
            return PartRecords(written, 0, 1)
        return PartRecords(written, self.plan.record_count - written, self.plan.chain_length)


@dataclass(eq=False)
class PartWrite:
    """One background write and, once it ended, its outcome."""

    checkpoint_id: str
    checkpoint_dir: str
    generation: int
    """The restore boundary its snapshot was cut in (`PartChains.generation`)."""
    fence: WriteFence = field(default_factory=WriteFence)
    task: asyncio.Task[PublishedPart] | None = None
    published: PublishedPart | None = None
    error: CheckpointError | None = None

    @property
    def state(self) -> PartWriteState:
        if self.published is not None:
            return PartWriteState.DURABLE
        if self.error is not None:
            return PartWriteState.FAILED
        return PartWriteState.WRITING


class PartWrites:
    """The participant's background writes: at most one running, the last outcomes kept."""

    def __init__(
        self,
        storage: CheckpointStorage,
        changed: Callable[[], None],
        durable: Callable[[PartWrite, PublishedPart], None] | None = None,
    ) -> None:
        self._storage = storage
        self._changed = changed
        self._durable = durable
        self._writes: OrderedDict[str, PartWrite] = OrderedDict()
        self._running: PartWrite | None = None

    def idle(self) -> asyncio.Future[None] | None:
        """What a new commit waits for before exporting: the running write's end (None when
        nothing runs)."""
        running = self._running
        if running is None or running.task is None or running.task.done():
            return None
        return asyncio.ensure_future(_ended(running.task))

    def get(self, checkpoint_id: str) -> PartWrite | None:
        return self._writes.get(checkpoint_id)

    def start(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        snapshot: PartSnapshot,
        generation: int,
    ) -> PartWrite:
        """Start writing `snapshot`, cut in restore `generation` (once per id: a second
        start returns the first write)."""
        existing = self._writes.get(checkpoint_id)
        if existing is not None:
            return existing
        write = PartWrite(checkpoint_id, checkpoint_dir, generation)
        self._writes[checkpoint_id] = write
        while len(self._writes) > OUTCOMES_KEPT:
            self._writes.popitem(last=False)
        self._running = write
        write.task = asyncio.get_running_loop().create_task(
            self._write(write, kind, instance, snapshot)
        )
        write.task.add_done_callback(retrieve_exception)
        return write

    async def _write(
        self, write: PartWrite, kind: str, instance: str, snapshot: PartSnapshot
    ) -> PublishedPart:
        plan = snapshot.plan
        call = (
            functools.partial(
                self._storage.write_part,
                write.checkpoint_dir,
                kind,
                instance,
                write.checkpoint_id,
                iter(snapshot.lines),
                write.fence,
            )
            if plan is None
            else functools.partial(
                plan.write, self._storage, kind, instance, write.checkpoint_id, write.fence
            )
        )
        try:
            published = await run_in_daemon_thread(call, f"part write {write.checkpoint_id}")
            write.published = published
            if snapshot.settled is not None:
                snapshot.settled(published)
            if self._durable is not None:
                self._durable(write, published)
        except StopRequested:
            write.error = CheckpointError(
                Reason.STORAGE_FAILED,
                "the participant shut down before the part was published",
                retry_after=1.0,
            )
            raise write.error from None
        except CheckpointError as error:
            write.error = error
            raise
        except Exception as exc:  # any failure of the write is the part's
            log.exception("checkpoint %s: the background write failed", write.checkpoint_id)
            write.error = CheckpointError(
                Reason.STORAGE_FAILED, f"the background write failed: {exc}"
            )
            raise write.error from exc
        finally:
            if write.published is None and snapshot.settled is not None:
                snapshot.settled(None)
            if self._running is write:
                self._running = None
            self._changed()
        return published

    def stop(self) -> None:
        """Abandon a write that has not begun publishing (the process is closing)."""
        if self._running is not None:
            self._running.fence.stop()


async def _ended(task: asyncio.Task[PublishedPart]) -> None:
    await asyncio.wait([task])
