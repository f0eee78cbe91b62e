"""Incremental parts of a multi-worker server: what each worker's share of a part holds.

A server with several workers is one participant writing one part per checkpoint
(worker_pool.py), but its sessions and their change clocks live in the workers: only a
worker knows which of its sessions were touched since a cut. So each worker's own
participant decides what its sessions contribute, exactly as in one process, and only the
touched sessions cross the local bridge at a checkpoint: the main process never names an
unchanged session, it keeps the base part's records minus what the workers say is gone
(`KeptRecords`). The rules each keep a published part equal, record for record, to a full
part of the same cut:

* The main process's cut is a number of its own (`PoolChanges.cut`); a worker reads its own
  change clock when it starts its share of that cut's export and keeps the pair
  (`WorkerShares`): the base of its next incremental export is its share of the base part,
  with the clock it read then, so a change that landed after that read is exported again.
* A worker's share of a part becomes its base only once the main process names that part as
  the base of a later export: the main process bases a part only on a *published* one
  (`part_chain`), so a failed, stopped or aborted write never becomes a worker's base, and its
  sessions stay changed.
* A part follows a change of workers in full (`PoolChanges.export`). A worker restarted or
  lost takes its sessions with it, and a replacement knows nothing of the base: keeping the
  base's records of its sessions would reference sessions the server no longer holds, and
  asking it what changed would find nothing to drop. Any registration or loss since the
  base's cut makes the next part full, for every worker (the simplest rule that is right
  whichever worker changed, and a worker change is rare).
* Every share is answered in the kept form (changed records, identities dropped from the
  base, how many the base keeps), whatever path the worker's participant took: a share that
  named every unchanged record (a scoped export, a log that no longer reaches the base) is
  turned into it in the worker, so the main process never keeps a base record twice.
* Records are merged in the order of their identity, which for a resources server is the
  order one process exports them in (episode, session id): an incremental part lists its
  records as a one-process part of the same sessions does, and the kept records of the base
  merge with the changed ones in one pass (`PartPlan`).
"""

from __future__ import annotations

import asyncio
import heapq
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.participant import (
    ChangeSet,
    ExportBase,
    ExportRecord,
    KeptRecords,
    Participant,
    UnchangedRecord,
)
from rollout_checkpoint.server.runtime.records_codec import serialize_records

CUTS_REMEMBERED = 64
"""Cuts whose worker membership the main process keeps: a base older than that many exports
(a run of failed commits) finds none and its next part is full."""

CallAll = Callable[[str, Any], Awaitable[dict[int, Any]]]
"""The pool's call of every worker: (op, body) -> {worker index: reply}."""
RecordIdentity = Callable[[EpisodeId, Mapping[str, Any]], Hashable]


def identity_to_json(identity: Hashable) -> list[Any]:
    """A record identity as the bridge carries it: a resources session's identity is a
    tuple of strings and integers (`session_identity`), a JSON list."""
    if not isinstance(identity, tuple):
        raise TypeError(f"an incremental record identity is a tuple, not {identity!r}")
    return list(identity)


def identity_from_json(value: Any) -> Hashable:
    return tuple(value)


class PoolChanges:
    """The main process's side: its cuts, the workers each cut was exported from, and the
    merge of the workers' shares into one `ChangeSet`."""

    def __init__(self) -> None:
        self._cut = 0
        self._membership = 0
        self._membership_at: OrderedDict[int, int] = OrderedDict()
        self._named: int | None = None
        self._exported: int | None = None
        """The cuts whose shares every worker holds (`WorkerShares`): the base it was last
        named, and the share it last exported. A part of any other cut is no base, whatever
        the chain says: a full export elsewhere (another root, a commit that then failed)
        replaced the workers' pending share, and naming that cut would fail every export."""

    def workers_changed(self) -> None:
        """A worker registered or was lost: no part from before may be a base any more."""
        self._membership += 1

    def cut(self) -> int:
        """A new cut (`Participant.change_clock`, read right before `export`)."""
        self._cut += 1
        self._membership_at[self._cut] = self._membership
        while len(self._membership_at) > CUTS_REMEMBERED:
            self._membership_at.popitem(last=False)
        return self._cut

    def usable(self, base: ExportBase | None) -> ExportBase | None:
        """`base`, unless a worker joined or left since its cut, or the workers no longer
        hold their shares of it (then the part is full)."""
        if base is None or self._membership_at.get(base.cut) != self._membership:
            return None
        if base.cut not in (self._named, self._exported):
            return None
        return base

    async def export(
        self, call_all: CallAll, scope_keys: Any, base: ExportBase | None, identity: RecordIdentity
    ) -> ChangeSet:
        """Every worker's share of the cut `cut` just returned, merged (see the module);
        `scope_keys`: the commit's scope as the bridge carries it."""
        base = self.usable(base)
        body = {"scope": scope_keys, "cut": self._cut, "base": None if base is None else base.cut}
        named = self._named if base is None else base.cut
        # Until every worker answered, which shares each holds is unknown (one may have
        # exported while another failed, or still be exporting): only a full part is safe.
        self._named = self._exported = None
        replies = await call_all("export_changes", body)
        self._named, self._exported = named, self._cut
        return await asyncio.to_thread(_merged, replies, base is not None, identity)


def decoded_records(lines: Sequence[str]) -> list[ExportRecord]:
    """A worker's exported lines as records (key order and big integers kept)."""
    records = []
    for line in lines:
        fields = json.loads(line)
        records.append(ExportRecord(EpisodeId.from_json(fields.pop("episode_id")), fields))
    return records


def _merged(replies: dict[int, Any], kept: bool, identity: RecordIdentity) -> ChangeSet:
    """The workers' shares as one change set; decodes records (blocks: run it in a thread)."""
    shares: list[list[ExportRecord]] = []
    dropped: set[Hashable] = set()
    count = 0
    for _, reply in sorted(replies.items()):
        shares.append(decoded_records(reply["lines"]))
        dropped.update(identity_from_json(item) for item in reply["dropped"])
        count += int(reply["kept"])

    def order(record: ExportRecord) -> Any:
        return identity(record.episode_id, record.fields)  # export order (`KeptRecords`)

    items = list(heapq.merge(*shares, key=order))
    if not kept:
        return ChangeSet(items)
    return ChangeSet(items, KeptRecords(frozenset(dropped), count))


@dataclass
class Share:
    """A worker's records in the part of one cut of the main process, as a base
    (`ExportBase`): `cut` is this worker's change clock read at that cut."""

    pool_cut: int
    cut: int
    complete: bool
    identities: set[Hashable]

    @property
    def record_count(self) -> int:
        return len(self.identities)

    def holds(self, identity: Hashable) -> bool:
        return identity in self.identities


@dataclass
class PendingShare:
    """A share exported but not yet known to be published: what it changed of its base
    (`base_cut` None: the share is `changed` alone)."""

    pool_cut: int
    clock: int
    complete: bool
    base_cut: int | None
    dropped: frozenset[Hashable] = frozenset()
    changed: set[Hashable] = field(default_factory=set)


class WorkerShares:
    """The worker's side: its share of the base part, and of the part being written."""

    def __init__(self, participant: Participant) -> None:
        self._participant = participant
        self._base: Share | None = None
        self._pending: PendingShare | None = None
        self._exports_started = 0
        """Only the export started last leaves its share pending: one the main process gave
        up on (its commit failed or ended at its deadline) may still end after the next
        commit's export here, and its older share would replace the one that commit names
        as its base next (that commit then failed once, `HOOK_FAILED`)."""

    def _base_of(self, pool_cut: int | None) -> Share | None:
        """This worker's share of the part of `pool_cut` (None: a full share).

        Named as a base, the pending share was published: it becomes the base, its delta
        applied in place (O(changed)). The main process names only a share every worker
        holds (`PoolChanges.usable`); a worker that still has none refuses the export."""
        if pool_cut is None:
            return None
        pending = self._pending
        if pending is not None and pending.pool_cut == pool_cut:
            self._pending = None
            if pending.base_cut is None:
                identities = pending.changed
            else:
                assert self._base is not None and self._base.pool_cut == pending.base_cut
                identities = self._base.identities
                identities -= pending.dropped
                identities |= pending.changed
            self._base = Share(pool_cut, pending.clock, pending.complete, identities)
        if self._base is None or self._base.pool_cut != pool_cut:
            raise ValueError(f"this worker holds no share of the part of cut {pool_cut}")
        return self._base

    async def export(
        self, scope: frozenset[EpisodeId] | None, pool_cut: int, base_cut: int | None
    ) -> dict[str, Any]:
        """This worker's share of the main process's cut `pool_cut`, in the kept form."""
        participant = self._participant
        self._exports_started += 1
        started = self._exports_started
        base = self._base_of(base_cut)
        clock = participant.change_clock()
        changes = await participant.export_changes(scope, base)
        own = [item for item in changes.items if isinstance(item, ExportRecord)]
        dropped, kept = _dropped_and_kept(changes, base)
        if started == self._exports_started:
            self._pending = PendingShare(
                pool_cut,
                clock,
                scope is None,
                None if base is None else base.pool_cut,
                dropped,
                {participant.record_identity(r.episode_id, r.fields) for r in own},
            )
        # Encoded here, in a thread, with the part's own codec (as a full export is).
        lines = await asyncio.to_thread(lambda: [line.decode() for line in serialize_records(own)])
        return {
            "lines": lines,
            "dropped": [identity_to_json(identity) for identity in dropped],
            "kept": kept,
        }


def _dropped_and_kept(changes: ChangeSet, base: Share | None) -> tuple[frozenset[Hashable], int]:
    """What the share drops of its base and how many base records it keeps: as the export
    said (`ChangeSet.kept`), or, from an export that named every unchanged record, the base's
    records it did not name (O(share), as that export itself)."""
    if base is None:
        return frozenset(), 0
    if changes.kept is not None:
        return changes.kept.dropped, changes.kept.count
    unchanged = {item.identity for item in changes.items if isinstance(item, UnchangedRecord)}
    return frozenset(base.identities - unchanged), len(unchanged)
