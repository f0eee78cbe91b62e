"""Incremental parts: which earlier part a commit may reference, and the lines that do.

An `incremental` participant (`Participant.export_changes`) exports only the records that
changed since the last part it published; every unchanged record becomes a reference line
(`part_references`) pointing at the line that holds it in an earlier part. The rules each
keep a published checkpoint restorable, byte for byte as a full part would be:

* Only a *published* part is referenced (`PartChains.published`, called once the manifest is
  durable): a failed, stopped or aborted write changes nothing, so what it exported stays
  changed for the next commit.
* A record is unchanged only if its last change (`Participant.change_clock`) is at most the
  clock read at the cut of the part that holds it. The clock is read before the export, so a
  change that lands during an export, or during an asynchronous write, leaves its record
  changed for the next commit.
* References never cross a restore boundary (`reset`): the first part after a Restore is
  full. A plan made before the reset never becomes the base afterwards (`generation`).
* References stay below the same root: the base must be a sibling directory of the new part,
  or on an object store a sibling prefix in the same bucket (another root, or a URL at the
  top of a bucket, gets a full part), and they are flattened (a reference
  points at the line holding the state, never at another reference), so a restore reads at
  most `full_every` parts.
* The chain is bounded: a full part every `full_every` parts, or sooner when more than
  `max_stale_share` of the bytes of the files the base references are records nobody
  references any more. Restores read only the referenced lines, so the chain's length
  bounds how many files a restore opens; the stale share bounds what retention must keep
  for a checkpoint (at most 1 / (1 - share) of its live records). It is decided before the
  export, from the base alone (an unchanged record is not exported at all, so it cannot be
  decided after), hence at most one part late.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import os
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, invalid_request
from rollout_checkpoint.server.core.layout import (
    REFERENCE_FIELD,
    PartChain,
    PartReference,
    is_reference_name,
)
from rollout_checkpoint.server.core.object_store import is_object_url, parse_object_url
from rollout_checkpoint.server.core.part_references import RecordPointer, reference_line
from rollout_checkpoint.server.core.part_storage import (
    CheckpointStorage,
    PublishedPart,
    WriteFence,
)
from rollout_checkpoint.server.runtime.participant import ChangeSet, ExportRecord, UnchangedRecord
from rollout_checkpoint.server.runtime.records_codec import encode_record

DEFAULT_FULL_EVERY = 8
DEFAULT_MAX_STALE_SHARE = 0.5
MAX_FULL_EVERY = 64
"""A chained manifest lists every file it references; 64 of them keep it far below the
manifest size limit."""

Identity = Callable[[ExportRecord], Hashable]


@dataclass(frozen=True, slots=True)
class ChainSettings:
    full_every: int = DEFAULT_FULL_EVERY
    max_stale_share: float = DEFAULT_MAX_STALE_SHARE


@dataclass(frozen=True, slots=True)
class RecordLocation:
    """Where a published record's line lies: the records file (`file`, one object shared by
    every line of that file, so grouping lines by file costs no hashing of its fields), and
    the line's offset, length (newline excluded) and sha256; and the record's episode."""

    episode_id: EpisodeId
    file: PartReference
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True, slots=True)
class PublishedChain:
    """The last part this participant published, as the next part may reference it.

    `locations` are in the part's order; `complete`: the part's export was unscoped (it holds
    every record exportable at its cut). `stale_share`: of the bytes of the files its records
    lie in, the share that none of its records is (superseded records, reference lines);
    `episodes` (records per capture key) and `exported` (those keys, sorted): what a part
    that keeps its records answers its Commit with. All computed once, when it is
    published, in the writer's thread."""

    root: str
    checkpoint: str
    chain_length: int
    cut: int
    locations: Mapping[Hashable, RecordLocation]
    generation: int
    stale_share: float
    complete: bool
    episodes: Mapping[str, int]
    exported: tuple[str, ...]

    @property
    def record_count(self) -> int:
        return len(self.locations)

    def holds(self, identity: Hashable) -> bool:
        return identity in self.locations


def _stale_share(locations: Mapping[Hashable, RecordLocation]) -> float:
    files = {id(loc.file): loc.file for loc in locations.values()}
    total = sum(f.bytes for f in files.values())
    live = sum(loc.length + 1 for loc in locations.values())
    return 1.0 - live / total if total else 0.0


class PartChains:
    """The participant's latest published part, the base of its next incremental part."""

    def __init__(
        self, settings: ChainSettings | None = None, allowed_roots: frozenset[str] = frozenset()
    ) -> None:
        self.settings = settings or ChainSettings()
        self._allowed_roots = allowed_roots
        """The allowed checkpoint roots (`allowed_root_locations`): a part at one of them
        is full, since its siblings lie outside every allowed root and storage refuses a
        reference there."""
        self._latest: PublishedChain | None = None
        self._generation = 0

    @property
    def latest(self) -> PublishedChain | None:
        return self._latest

    @property
    def generation(self) -> int:
        """How many restore boundaries this process crossed: what was published before the
        last one belongs to an abandoned history."""
        return self._generation

    def reset(self) -> None:
        """A restore boundary: nothing published before it is referenced after it."""
        self._latest = None
        self._generation += 1

    def plan(
        self,
        checkpoint_dir: str,
        cut: int,
        changes: ChangeSet,
        base: PublishedChain | None,
        identity: Identity,
        complete: bool,
    ) -> PartPlan:
        return PartPlan(checkpoint_dir, cut, changes, base, identity, self._generation, complete)

    def base_for(self, checkpoint_dir: str) -> PublishedChain | None:
        """The part a commit into `checkpoint_dir` may reference, or None for a full part."""
        base = self._latest
        sibling = _root_and_name(checkpoint_dir)
        if base is None or sibling is None or checkpoint_dir in self._allowed_roots:
            return None
        root, name = sibling
        if base.root != root or base.checkpoint == name:
            return None
        if not is_reference_name(base.checkpoint):
            # A controller may name its directories freely (a timestamp with colons); a
            # reference may not hold such a name, and `write_part` would refuse the plan.
            return None
        if base.chain_length >= min(self.settings.full_every, MAX_FULL_EVERY):
            return None
        if base.stale_share > self.settings.max_stale_share:
            return None
        return base

    def settled(self, plan: PartPlan, part: PublishedPart | None) -> None:
        """The plan's write ended. Published (`part`): it becomes the base, unless a restore
        came since. Failed with references: its base is dropped, so the next part is full
        rather than referencing, again, files that may be what made it fail (deleted by an
        operator, refused by `write_part`'s check); a failure costs one full part, never a
        chain that can no longer publish."""
        if plan.generation != self._generation or _root_and_name(plan.checkpoint_dir) is None:
            return
        if part is not None:
            assert plan.published is not None, "settled before the plan's write noted it"
            self._latest = plan.published
        elif plan.references_base and self._latest is plan.base:
            self._latest = None


@dataclass(eq=False)
class PartPlan:
    """One commit's lines: its own records and its references, in the export's order.

    The cut needs only the own records' bytes (`encode_own`: the exported state, fixed
    before the data plane runs again, and a record JSON cannot carry must fail the Commit).
    Everything else is the write's, in its thread (`write`): where each unchanged record lies
    in the base, the reference lines, the own lines' digests, the chain the manifest states and
    the locations the next part references. Done in the pause, that work grew with every
    session held, touched or not (0.1-0.2 s at 10,000 sessions), while the cut's own work
    grows only with what changed."""

    checkpoint_dir: str
    cut: int
    changes: ChangeSet
    base: PublishedChain | None
    identity: Identity
    generation: int
    complete: bool
    """The export was unscoped: the part holds every record exportable at its cut."""

    def __post_init__(self) -> None:
        kept = self.changes.kept
        assert kept is None or self.base is not None, "records kept without a base"
        self.references_base = self.base is not None and (
            kept.count > 0
            if kept is not None
            else any(isinstance(item, UnchangedRecord) for item in self.changes.items)
        )
        """Whether the part references its base (a chained part), known without locating."""
        self.record_count = len(self.changes.items) + (kept.count if kept is not None else 0)
        base = self.base
        self.chain_length = (
            base.chain_length + 1 if base is not None and self.references_base else 1
        )
        """How many parts a restore of this one reads at most (1: a full part)."""
        self.published: PublishedChain | None = None
        """What the next part may reference, once `write` published this one."""
        self._items: Sequence[ExportRecord | UnchangedRecord] | None = None
        self._encoded: tuple[bytes, ...] | None = None
        self._layout: _Layout | None = None

    @property
    def items(self) -> Sequence[ExportRecord | UnchangedRecord]:
        """Every record of the part in export order: the base's kept records merged with
        the changed ones. O(every record), so the write's work (its thread), never the
        pause's."""
        if self._items is None:
            self._items = self._merged()
        return self._items

    def _merged(self) -> Sequence[ExportRecord | UnchangedRecord]:
        kept = self.changes.kept
        if kept is None:
            return self.changes.items
        assert self.base is not None
        dropped = kept.dropped
        unchanged = [
            UnchangedRecord(location.episode_id, identity)
            for identity, location in self.base.locations.items()
            if identity not in dropped
        ]
        identity = self.identity

        def key(item: ExportRecord | UnchangedRecord) -> Any:
            # `KeptRecords`: a kept record's identity is its export-order key.
            return item.identity if isinstance(item, UnchangedRecord) else identity(item)

        return list(heapq.merge(unchanged, self.changes.items, key=key))

    def exported_keys(self) -> tuple[str, ...]:
        """The sorted capture keys of the part's episodes (the Commit's reply), in O(changed)
        when the part keeps its base's records: the base's keys, changed only by the
        episodes whose last record went or whose first one came."""
        kept = self.changes.kept
        if kept is None or not kept.count:
            return exported_keys(self.changes.items)
        assert self.base is not None
        locations, held = self.base.locations, self.base.episodes
        delta: dict[str, int] = {}
        for identity in kept.dropped:
            key = locations[identity].episode_id.capture_key
            delta[key] = delta.get(key, 0) - 1
        for record in self.changes.items:
            key = record.episode_id.capture_key
            delta[key] = delta.get(key, 0) + 1
        flipped = [k for k, d in delta.items() if (held.get(k, 0) + d > 0) != (k in held)]
        if not flipped:
            return self.base.exported
        keys = list(self.base.exported)  # sorted; a few insertions and deletions in place
        for key in flipped:  # (a set rebuilt and re-sorted cost ~5 ms of a 10,000-key pause)
            at = bisect.bisect_left(keys, key)
            if key in held:
                del keys[at]
            else:
                keys.insert(at, key)
        return tuple(keys)

    def moved_to(self, checkpoint_dir: str) -> PartPlan:
        """This plan for a commit retried into another directory (the first one failed: a
        bad directory). Its export is kept (never re-exported: that would store state from
        after the cut), so its references must still be siblings of the new directory."""
        if self.references_base:
            assert self.base is not None
            sibling = _root_and_name(checkpoint_dir)
            if (
                sibling is None
                or sibling[0] != self.base.root
                or sibling[1] == self.base.checkpoint
            ):
                raise invalid_request(
                    "checkpoint_dir",
                    "a retried incremental commit must stay beside the part it references "
                    f"({self.base.root}/{self.base.checkpoint})",
                )
        return PartPlan(
            checkpoint_dir,
            self.cut,
            self.changes,
            self.base,
            self.identity,
            self.generation,
            self.complete,
        )

    def encode_own(self) -> tuple[bytes, ...]:
        """The own records' lines, kept for the write; blocks (run it in a thread)."""
        if self._encoded is None:
            self._encoded = tuple(
                self._own_line(item)
                for item in self.changes.items
                if isinstance(item, ExportRecord)
            )
        return self._encoded

    def write(
        self,
        storage: CheckpointStorage,
        kind: str,
        instance: str,
        checkpoint_id: str,
        fence: WriteFence,
    ) -> PublishedPart:
        """Compose, write and publish the part, then note what the next part may reference
        (`published`); blocks (the writer's thread)."""
        part = storage.write_part(
            self.checkpoint_dir, kind, instance, checkpoint_id, self._lines(), fence, self._chain()
        )
        self.published = self._published_chain(part)
        return part

    def _located(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout.of(self.items, self.base)
        return self._layout

    def _chain(self) -> PartChain | None:
        """What the manifest says of the chain (None: a full part, manifest version 1)."""
        layout = self._located()
        if not layout.references:
            return None
        assert self.base is not None
        located = layout.located.values()
        return PartChain(
            own_records=len(self.items) - len(located),
            referenced_records=len(located),
            referenced_bytes=sum(loc.length + 1 for loc in located),
            chain_length=self.chain_length,
            references=layout.references,
        )

    def _lines(self) -> Iterator[bytes]:
        """Every line of the part, each own record's place and sha256 noted as it goes."""
        layout = self._located()
        own = iter(self.encode_own())
        layout.own.clear()
        offset = 0
        for item in self.items:
            if isinstance(item, UnchangedRecord):
                location = layout.located[id(item)]
                pointer = RecordPointer(
                    layout.index[id(location.file)],
                    location.offset,
                    location.length,
                    location.sha256,
                )
                line = reference_line(pointer)
            else:
                line = next(own)
                digest = hashlib.sha256(line).hexdigest()
                layout.own.append((self.identity(item), offset, len(line), digest))
            yield line
            offset += len(line) + 1

    def _own_line(self, record: ExportRecord) -> bytes:
        if REFERENCE_FIELD in record.fields:
            raise CheckpointError(
                Reason.UNSERIALIZABLE_STATE,
                f"the record of {record.episode_id.capture_key} uses the reserved field "
                f"{REFERENCE_FIELD}",
                metadata={"captureKey": record.episode_id.capture_key},
            )
        return encode_record(record)

    def _published_chain(self, part: PublishedPart) -> PublishedChain | None:
        sibling = _root_and_name(self.checkpoint_dir)
        if sibling is None:
            return None  # no sibling can reference it (`settled` makes it no base)
        root, name = sibling
        manifest = part.manifest
        own_file = PartReference(name, manifest.records_file, manifest.bytes)
        layout = self._located()
        located, own = layout.located, iter(layout.own)
        locations: dict[Hashable, RecordLocation] = {}
        for item in self.items:
            if isinstance(item, UnchangedRecord):
                locations[item.identity] = located[id(item)]
            else:
                identity, offset, length, digest = next(own)
                locations[identity] = RecordLocation(
                    item.episode_id, own_file, offset, length, digest
                )
        episodes: dict[str, int] = {}
        for location in locations.values():
            key = location.episode_id.capture_key
            episodes[key] = episodes.get(key, 0) + 1
        return PublishedChain(
            root,
            name,
            manifest.chain_length,
            self.cut,
            locations,
            self.generation,
            _stale_share(locations),
            self.complete,
            episodes,
            tuple(sorted(episodes)),
        )


@dataclass(eq=False, slots=True)
class _Layout:
    """Where a plan's unchanged records lie in its base (`located`, by the item's id), the
    files they lie in (`references`, in the manifest's order, `index` by the file's id), and
    the own lines' places noted while the lines are composed (`own`)."""

    located: dict[int, RecordLocation]
    references: tuple[PartReference, ...]
    index: dict[int, int]
    own: list[tuple[Hashable, int, int, str]]

    @classmethod
    def of(
        cls, items: Sequence[ExportRecord | UnchangedRecord], base: PublishedChain | None
    ) -> _Layout:
        located = (
            {
                id(item): base.locations[item.identity]
                for item in items
                if isinstance(item, UnchangedRecord)
            }
            if base is not None
            else {}
        )
        files = {id(loc.file): loc.file for loc in located.values()}
        references = tuple(sorted(files.values(), key=lambda f: (f.checkpoint, f.records_file)))
        return cls(located, references, {id(f): i for i, f in enumerate(references)}, [])


def _root_and_name(checkpoint_dir: str) -> tuple[str, str] | None:
    """The root a checkpoint location lies in and its name there: a directory's parent, or
    an object URL's parent prefix (same bucket). None for a URL at the top of a bucket, which
    has no siblings: its part is full and references nothing (a reference names a sibling)."""
    if not is_object_url(checkpoint_dir):
        return os.path.split(checkpoint_dir.rstrip("/"))
    split = parse_object_url(checkpoint_dir).split()
    return None if split is None else (split[0].url, split[1])


def exported_keys(records: Sequence[ExportRecord | UnchangedRecord]) -> tuple[str, ...]:
    """The sorted capture keys of the records' episodes, each once. Deduplicated in the
    records' order (the export's, by episode), so the sort gets a nearly sorted list: from a
    set's hash order, sorting 10,000 keys cost the pause about three times as much."""
    return tuple(sorted(dict.fromkeys([r.episode_id.capture_key for r in records])))
