"""A worker's pending share is the one of the export that started last.

The main process ends a commit whose worker export did not answer in time (its deadline, a
failure elsewhere), and its next commit starts another export on the same worker while the
first may still run there. When the older export finished last, it replaced the newer one's
pending share: the next commit named the newer part as its base, the worker held no share
of it, and that commit failed (`HOOK_FAILED ... holds no share`) before the one after it
went full. A late export no longer touches the pending share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.participant import (
    ChangeSet,
    ExportBase,
    ExportRecord,
    UnchangedRecord,
)
from rollout_checkpoint.server.runtime.worker_changes import WorkerShares

SESSIONS = [EpisodeId(f"s{n}", 0) for n in range(3)]


def identity(episode: EpisodeId) -> tuple[str]:
    """A session's identity, as the bridge carries it (a tuple)."""
    return (episode.rollout_id,)


class Sessions:
    """The few methods `WorkerShares` calls of a worker's participant: three sessions, each
    changed by `touch`; an export waits at `gate` while it is set to an unset event."""

    def __init__(self) -> None:
        self.clock = 0
        self.stamps = {episode: 0 for episode in SESSIONS}
        self.gate: asyncio.Event | None = None

    def touch(self, episode: EpisodeId) -> None:
        self.clock += 1
        self.stamps[episode] = self.clock

    def change_clock(self) -> int:
        return self.clock

    def record_identity(self, episode: EpisodeId, record: Mapping[str, Any]) -> Hashable:
        return identity(episode)

    async def export_changes(
        self, scope: frozenset[EpisodeId] | None, base: ExportBase | None
    ) -> ChangeSet:
        stamps = dict(self.stamps)
        gate = self.gate
        if gate is not None:
            await gate.wait()
        items: list[ExportRecord | UnchangedRecord] = []
        for episode, stamp in stamps.items():
            if base is not None and stamp <= base.cut and base.holds(identity(episode)):
                items.append(UnchangedRecord(episode, identity(episode)))
            else:
                items.append(ExportRecord(episode, {"stamp": stamp}))
        return ChangeSet(items)


async def test_an_export_that_ends_after_a_later_one_leaves_the_later_share_pending() -> None:
    sessions = Sessions()
    shares = WorkerShares(sessions)  # type: ignore[arg-type]
    await shares.export(None, pool_cut=1, base_cut=None)  # part 1, published
    sessions.touch(SESSIONS[0])
    sessions.gate = asyncio.Event()
    stalled = asyncio.create_task(shares.export(None, pool_cut=2, base_cut=1))
    await asyncio.sleep(0)  # it runs up to the gate: its commit gives up on it
    release, sessions.gate = sessions.gate, None
    sessions.touch(SESSIONS[1])
    later = await shares.export(None, pool_cut=3, base_cut=1)  # part 3, published
    assert later["kept"] == 1 and len(later["lines"]) == 2
    release.set()
    await stalled  # the export the main process no longer waits for ends last
    sessions.touch(SESSIONS[2])
    after = await shares.export(None, pool_cut=4, base_cut=3)  # refused before the fix
    assert after["kept"] == 2 and len(after["lines"]) == 1
