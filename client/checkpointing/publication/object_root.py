"""A checkpoint root on an object store (`s3://bucket/prefix`): publication, `LATEST`,
retention and verification with the same guarantees as `CheckpointRoot` on disk.

    <url>/LATEST                                       id of the latest publication
    <url>/<checkpoint_id>/checkpoint.json              the fleet manifest (last)
    <url>/<checkpoint_id>/participants/<kind>/<instance>/{manifest.json,records-<sha256>.jsonl}

Each step of the local publication (see the package doc) has its object-store form:

1. **Verify every part first**, streaming every records object through the participants'
   own part reader; a fleet manifest written before would promise a restore that fails.
2. (Durability of the parts' entries is the store's: a completed PUT is durable.)
3. **The fleet manifest is created only if absent** (`If-None-Match: *`): a published
   checkpoint never changes, of two racing publishers exactly one wins, an identical
   manifest is an idempotent retry and a different one is `CheckpointConflict`.
4. **`LATEST` moves only forward, by compare-and-swap**: it is read with its ETag, and
   replaced only if it still has that ETag (`If-Match`; `If-None-Match: *` when absent).
   A writer that lost the race reads again and decides again, so a late retry of an older
   publication never moves `LATEST` back behind a newer one, even when two publishers race.
5. **Retention last, deleting only what no `LATEST` names**: `LATEST` is read again right
   before each deletion, and a published checkpoint loses its `checkpoint.json` first, so a
   deletion cut short never leaves a checkpoint that looks published but lost parts (the
   object-store form of the rename to a trash name). Never a checkpoint whose records a kept
   one references (incremental parts), transitively; and nothing at all when a part's manifest
   cannot be read, since what it references is then unknown (`retention.referenced_closure`).

Everything here blocks (network I/O, hashing): run it in a thread from asyncio code.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from enum import Enum
from typing import Any, TypeVar

from rollout_checkpoint.client.checkpointing.publication.errors import (
    CheckpointConflict,
    CheckpointCorrupt,
    NoPublishedCheckpoint,
    PublicationError,
    StorageFailed,
)
from rollout_checkpoint.client.checkpointing.publication.manifest import (
    FleetManifest,
    PublishedParticipant,
    parse_time,
)
from rollout_checkpoint.client.checkpointing.publication.retention import (
    manifest_references,
    referenced_closure,
)
from rollout_checkpoint.client.checkpointing.publication.root import (
    PendingRetention,
    PublishedCheckpoint,
    check_continued,
    check_participants,
    stop_if_abandoned,
)
from rollout_checkpoint.client.checkpointing.publication.verify import (
    CheckpointSummary,
    ParticipantSummary,
)
from rollout_checkpoint.server.core import daemon_threads, layout
from rollout_checkpoint.server.core.episodes import EpisodeId, is_valid_id
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, corrupt_checkpoint
from rollout_checkpoint.server.core.extras import MissingExtra
from rollout_checkpoint.server.core.layout import (
    FLEET_MANIFEST_NAME,
    LATEST_NAME,
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    PARTICIPANTS_DIR,
    load_json,
)
from rollout_checkpoint.server.core.object_parts import scan_part_records
from rollout_checkpoint.server.core.object_references import read_object_manifest_bytes
from rollout_checkpoint.server.core.object_store import (
    ObjectLocation,
    ObjectStoreClient,
    ObjectStoreFailure,
    StoredObject,
    client_for,
    parse_object_url,
)
from rollout_checkpoint.server.core.part_reader import check_owner, decode_manifest

CrashHook = Callable[[str], None]
_T = TypeVar("_T")


class _Depth(Enum):
    """How much of a part a verification reads."""

    SIZES = "sizes"
    """Sizes only (`verify_records=False`)."""
    OWN_RECORDS = "own records"
    """A publication's: the part's own records object hashed whole; the parts a chained part
    references checked still published, of this participant, naming that object with that
    size, but not downloaded: each was verified when it was published, and reading them
    again would cost about every participant's live bytes at every checkpoint (inside the
    pause of a synchronous commit)."""
    EVERY_LINE = "every line"
    """`inspect`'s: every referenced line read and hashed too, as a Restore does."""

    def scan_options(self) -> dict[str, bool]:
        return {
            "size_only": self is _Depth.SIZES,
            "read_references": self is _Depth.EVERY_LINE,
        }


_OLDEST = datetime.min.replace(tzinfo=UTC)
_LATEST_SWAPS = 16
"""How often a publication re-reads LATEST after losing its compare-and-swap to another."""


def _store_errors(error: ObjectStoreFailure | MissingExtra) -> PublicationError:
    """A store that failed (unreachable, refusing, erring) is `StorageFailed`; a missing
    `[s3]` extra is a configuration error, no failure of the store."""
    if isinstance(error, ObjectStoreFailure):
        return StorageFailed(str(error))
    return PublicationError(str(error))


class ObjectCheckpointRoot:
    """The controller's checkpoint root below an object-store URL (see the module doc).

    The same methods as `CheckpointRoot`; `directory()` returns the checkpoint's URL."""

    def __init__(
        self,
        url: str,
        *,
        clock: Callable[[], datetime] | None = None,
        crash_hook: CrashHook | None = None,
    ) -> None:
        """Use the root below `url` (nothing is created until a participant commits).

        ValueError for a URL that is not a valid object-store location; PublicationError
        when the client cannot be configured (or the `[s3]` extra is missing)."""
        self.root = parse_object_url(url)
        self.location = self.root.url
        self._clock = clock or (lambda: datetime.now(UTC))
        self._crash_hook = crash_hook
        self._lock = threading.Lock()
        try:
            self._client: ObjectStoreClient = client_for(self.root)
        except (ObjectStoreFailure, MissingExtra) as exc:
            raise _store_errors(exc) from None

    def __repr__(self) -> str:
        return f"ObjectCheckpointRoot({self.location!r})"

    def _step(self, name: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(name)
        stop_if_abandoned(self.location, name)

    # -- ids ------------------------------------------------------------------------------

    def new_checkpoint_id(self) -> str:
        """`ckpt-<UTC YYYYmmddTHHMMSSZ>-<8 hex>`, not yet used under this root."""
        while True:
            stamp = self._clock().astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
            checkpoint_id = f"ckpt-{stamp}-{secrets.token_hex(4)}"
            if not self._call(
                functools.partial(self._client.list_below, self.root.key(checkpoint_id))
            ):
                return checkpoint_id

    def directory(self, checkpoint_id: str) -> str:
        """`<url>/<checkpoint_id>`; ValueError for anything that is not a checkpoint id."""
        _check_checkpoint_id(checkpoint_id)
        return self.root.child(checkpoint_id).url

    # -- publish --------------------------------------------------------------------------

    def publish(
        self,
        checkpoint_id: str,
        participants: Sequence[PublishedParticipant],
        continued: Iterable[EpisodeId],
        controller_state: bytes,
        *,
        keep: int = 2,
        created_at: datetime | None = None,
        verify_records: bool = True,
        defer_retention: bool = False,
    ) -> PublishedCheckpoint:
        """Verify every part, create `checkpoint.json`, move `LATEST` forward, apply
        retention; `CheckpointRoot.publish`'s contract (and its result type)."""
        _check_checkpoint_id(checkpoint_id)
        entries = check_participants(participants)
        episodes = check_continued(continued)
        if not isinstance(controller_state, bytes | bytearray | memoryview):
            raise TypeError("controller_state must be bytes")
        state = bytes(controller_state)
        if type(keep) is not int or keep < 1:
            raise ValueError("keep must be an integer >= 1")
        if created_at is not None and created_at.utcoffset() is None:
            raise ValueError("created_at must be timezone-aware")
        ckpt = self.root.child(checkpoint_id)
        with self._lock:
            objects = self._call(lambda: self._client.list_below(ckpt.prefix))
            if not objects:
                raise CheckpointCorrupt(
                    ckpt.url, "no such checkpoint directory: no participant has committed"
                )
            # Before this publication adds an object: what retention compares unpublished
            # checkpoints with (those started before this one are abandoned attempts).
            reference = min(o.last_modified for o in objects)
            for entry in entries:
                depth = _Depth.OWN_RECORDS if verify_records else _Depth.SIZES
                self._verify_part(ckpt, entry, checkpoint_id, depth=depth)
            self._step("after_verify")
            fleet_key = ckpt.key(FLEET_MANIFEST_NAME)
            existing = self._call(lambda: self._client.get(fleet_key))
            if created_at is None:
                created_at = _created_at_of(existing) or self._clock()
            manifest = FleetManifest(
                checkpoint_id, created_at.astimezone(UTC), entries, episodes, state
            )
            data = manifest.encode()
            already = False
            if existing is None:
                created = self._call(lambda: self._client.create(fleet_key, data))
                if not created:
                    existing = self._call(lambda: self._client.get(fleet_key))
            if existing is not None:
                if existing.data != data:
                    raise CheckpointConflict(
                        f"{ckpt.url}: checkpoint {checkpoint_id} is already published with a "
                        "different fleet manifest"
                    )
                already = True
            self._step("after_fleet_manifest")
            self._move_latest(checkpoint_id, manifest.created_at)
            self._step("after_latest")
            published = PublishedCheckpoint(
                checkpoint_id,
                ckpt.url,
                hashlib.sha256(data).hexdigest(),
                manifest,
                already_published=already,
                pending_retention=PendingRetention(keep, reference),
            )
            if defer_retention:
                return published
            return self._retain(published)

    def complete_retention(self, published: PublishedCheckpoint) -> PublishedCheckpoint:
        """`CheckpointRoot.complete_retention` on the store."""
        if published.pending_retention is None:
            return published
        with self._lock:
            return self._retain(published)

    def _retain(self, published: PublishedCheckpoint) -> PublishedCheckpoint:
        pending = published.pending_retention
        assert pending is not None and isinstance(pending.unpublished_before, datetime)
        deleted = self._apply_retention(
            pending.keep, published.checkpoint_id, pending.unpublished_before
        )
        return replace(published, deleted=deleted, pending_retention=None)

    def _move_latest(self, checkpoint_id: str, created_at: datetime) -> None:
        """Point LATEST at `checkpoint_id` unless it names a newer published checkpoint; by
        compare-and-swap on LATEST's ETag, re-deciding after every lost race."""
        key = self.root.key(LATEST_NAME)
        body = f"{checkpoint_id}\n".encode()
        for _ in range(_LATEST_SWAPS):
            current = self._call(lambda: self._client.get(key, limit=layout.LATEST_LIMIT))
            named = _latest_id(current)
            if named == checkpoint_id:
                return
            if named is not None and self._created_at(named) > created_at:
                return  # a newer publication: never move LATEST back
            if self._call(functools.partial(self._client.swap, key, body, current)):
                return
        raise StorageFailed(
            f"{self.location}: LATEST kept changing under {_LATEST_SWAPS} compare-and-swaps"
        )

    def _created_at(self, checkpoint_id: str) -> datetime:
        """created_at of a published checkpoint (oldest when unpublished or unreadable)."""
        stored = self._call(
            lambda: self._client.get(self.root.key(checkpoint_id, FLEET_MANIFEST_NAME))
        )
        return _created_at_of(stored) or _OLDEST

    def _verify_part(
        self, ckpt: ObjectLocation, entry: PublishedParticipant, checkpoint_id: str, depth: _Depth
    ) -> tuple[ParticipantSummary, int]:
        part = ckpt.child(*layout.part_components(entry.kind, entry.instance))
        keys: list[str] = []

        def episode(record: dict[str, Any], number: int) -> None:
            try:
                keys.append(EpisodeId.from_json(record.get("episode_id")).capture_key)
            except ValueError as exc:
                raise corrupt_checkpoint(
                    f"line {number} has an invalid episode_id: {exc}", part.url
                ) from exc

        try:
            raw = self._call(lambda: read_object_manifest_bytes(self._client, part))
            if raw is None:
                raise CheckpointCorrupt(part.url, "missing: the participant's part is not here")
            digest = hashlib.sha256(raw).hexdigest()
            if digest != entry.manifest_sha256:
                raise CheckpointCorrupt(
                    f"{part.url}/{MANIFEST_NAME}",
                    f"manifest digest mismatch: its sha256 is {digest}, the fleet manifest "
                    f"records {entry.manifest_sha256}",
                )
            manifest = decode_manifest(raw, part.url)
            check_owner(manifest, part.url, entry.kind, entry.instance, checkpoint_id)
            self._call(
                lambda: scan_part_records(
                    self._client, ckpt, manifest, episode, **depth.scan_options()
                )
            )
        except CheckpointError as error:
            if error.reason == Reason.STORAGE_FAILED:
                raise StorageFailed(error.message) from None
            raise CheckpointCorrupt(error.metadata.get("path", part.url), error.message) from None
        unique = tuple(sorted(set(keys)))
        summary = ParticipantSummary(
            name=entry.name,
            kind=entry.kind,
            instance=entry.instance,
            manifest_sha256=digest,
            records_file=manifest.records_file,
            records_sha256=manifest.records_sha256,
            record_count=manifest.record_count,
            bytes=manifest.bytes,
            episodes=unique,
            referenced_records=manifest.referenced_records,
            chain_length=manifest.chain_length,
        )
        return summary, len(keys) - len(unique)

    # -- retention ------------------------------------------------------------------------

    def _apply_retention(
        self, keep: int, just_published: str, reference: datetime
    ) -> tuple[str, ...]:
        """`retention.apply_retention`'s rules on the store. Never raises for a failed
        deletion (the publication succeeded; the next one retries what is left)."""
        try:
            published, unpublished, manifests = self._scan()
        except PublicationError:
            return ()
        newest_first = sorted(published, reverse=True)
        survivors = {name for _, name in newest_first[:keep]} | {just_published}
        doomed = [name for _, name in newest_first[keep:] if name not in survivors]
        doomed += [
            name for name, first in unpublished if first < reference and name != just_published
        ]
        kept = {name for _, name in published} | {name for name, _ in unpublished}
        try:
            referenced = referenced_closure(
                kept - set(doomed),
                lambda name: self._call(
                    lambda: _references_in(self._client, manifests.get(name, ()))
                ),
            )
        except PublicationError:
            return ()  # a manifest that cannot be read: delete nothing a kept one may need
        doomed = [name for name in doomed if name not in referenced]
        deleted: list[str] = []
        for name in doomed:
            if daemon_threads.abandoned():
                break  # the caller gave up at its deadline: the next publication goes on
            try:
                # Read LATEST right before each deletion: never delete what it names.
                latest = _latest_id(
                    self._call(
                        lambda: self._client.get(
                            self.root.key(LATEST_NAME), limit=layout.LATEST_LIMIT
                        )
                    )
                )
                if name == latest:
                    continue
                self._delete_checkpoint(name)
                deleted.append(name)
            except (PublicationError, CheckpointCorrupt):
                continue
        return tuple(sorted(deleted))

    def _scan(
        self,
    ) -> tuple[list[tuple[datetime, str]], list[tuple[str, datetime]], dict[str, list[str]]]:
        """Published checkpoints (created_at, id), unpublished ones (id, first write), and
        the keys of every checkpoint's part manifests: only prefixes named like checkpoint ids
        whose objects are what a checkpoint holds."""
        published: list[tuple[datetime, str]] = []
        unpublished: list[tuple[str, datetime]] = []
        manifests: dict[str, list[str]] = {}
        for name in self._call(lambda: self._client.children(self.root.prefix)):
            if name == LATEST_NAME or not is_valid_id(name):
                continue
            objects = self._call(functools.partial(self._client.list_below, self.root.key(name)))
            relative = {o.key.removeprefix(self.root.key(name) + "/") for o in objects}
            manifests[name] = [self.root.key(name, r) for r in sorted(relative) if _is_part(r)]
            if FLEET_MANIFEST_NAME in relative:
                published.append((self._created_at(name), name))
            elif objects and all(r.startswith(PARTICIPANTS_DIR + "/") for r in relative):
                unpublished.append((name, min(o.last_modified for o in objects)))
        return published, unpublished, manifests

    def _delete_checkpoint(self, name: str) -> None:
        """checkpoint.json first (from then on it is no longer published), then the rest."""
        prefix = self.root.key(name)
        self._call(lambda: self._client.delete([f"{prefix}/{FLEET_MANIFEST_NAME}"]))
        keys = [o.key for o in self._call(lambda: self._client.list_below(prefix))]
        for start in range(0, len(keys), 1000):
            self._call(functools.partial(self._client.delete, keys[start : start + 1000]))

    # -- read -----------------------------------------------------------------------------

    def latest(self) -> str | None:
        """The id `LATEST` names (None before any publication); `CheckpointCorrupt` when it is
        malformed or names a checkpoint with no fleet manifest."""
        stored = self._call(
            lambda: self._client.get(self.root.key(LATEST_NAME), limit=layout.LATEST_LIMIT)
        )
        if stored is None:
            return None
        checkpoint_id = _latest_id(stored)
        if checkpoint_id is None:
            raise CheckpointCorrupt(
                f"{self.location}/{LATEST_NAME}", "LATEST does not hold a checkpoint id"
            )
        if not self._call(
            lambda: self._client.exists(self.root.key(checkpoint_id, FLEET_MANIFEST_NAME))
        ):
            raise CheckpointCorrupt(
                f"{self.location}/{LATEST_NAME}",
                f"LATEST names {checkpoint_id}, which has no {FLEET_MANIFEST_NAME} "
                "(it was never published)",
            )
        return checkpoint_id

    def load(self, checkpoint_id_or_latest: str | None = None) -> FleetManifest:
        """The verified fleet manifest of a published checkpoint (None or "LATEST": latest),
        as `CheckpointRoot.load`."""
        return self.inspect(checkpoint_id_or_latest).manifest

    def inspect(self, checkpoint_id_or_latest: str | None = None) -> CheckpointSummary:
        """The whole verified summary of a published checkpoint (None or "LATEST": latest)."""
        if checkpoint_id_or_latest is None or checkpoint_id_or_latest == LATEST_NAME:
            checkpoint_id = self.latest()
            if checkpoint_id is None:
                raise NoPublishedCheckpoint(f"{self.location}: no checkpoint was published yet")
        else:
            checkpoint_id = checkpoint_id_or_latest
            _check_checkpoint_id(checkpoint_id)
        return self.verify(self.root.child(checkpoint_id), expected_id=checkpoint_id)

    def verify(self, ckpt: ObjectLocation, *, expected_id: str | None) -> CheckpointSummary:
        """Verify the checkpoint below `ckpt` completely (`verify_checkpoint` on the store)."""
        stored = self._call(lambda: self._client.get(ckpt.key(FLEET_MANIFEST_NAME)))
        if stored is None:
            raise NoPublishedCheckpoint(f"{ckpt.url}: checkpoint was never published")
        fleet_url = f"{ckpt.url}/{FLEET_MANIFEST_NAME}"
        try:
            manifest = FleetManifest.decode(stored.data)
        except ValueError as exc:
            raise CheckpointCorrupt(fleet_url, f"invalid fleet manifest: {exc}") from exc
        warnings: list[str] = []
        if expected_id is not None and manifest.checkpoint_id != expected_id:
            raise CheckpointCorrupt(
                fleet_url, f"the fleet manifest is of {manifest.checkpoint_id}, not {expected_id}"
            )
        name = ckpt.prefix.rsplit("/", 1)[-1]
        if expected_id is None and name != manifest.checkpoint_id:
            warnings.append(
                f"the directory is named {name!r} but holds checkpoint {manifest.checkpoint_id}"
            )
        summaries: list[ParticipantSummary] = []
        for entry in manifest.participants:
            summary, duplicates = self._verify_part(
                ckpt, entry, manifest.checkpoint_id, depth=_Depth.EVERY_LINE
            )
            summaries.append(summary)
            if duplicates:
                warnings.append(
                    f"{entry.name}: {duplicates} record(s) repeat an episode already in the part"
                )
        return CheckpointSummary(
            directory=ckpt.url,
            fleet_manifest_sha256=hashlib.sha256(stored.data).hexdigest(),
            manifest=manifest,
            participants=tuple(summaries),
            warnings=tuple(warnings),
        )

    def published(self) -> list[str]:
        """Ids of the published checkpoints, oldest first (by created_at, ties by id)."""
        return [name for _, name in sorted(self._scan()[0])]

    def read_fleet_manifest(self, checkpoint_id: str) -> FleetManifest:
        """The fleet manifest of a published checkpoint, decoded (not verified)."""
        stored = self._call(
            lambda: self._client.get(self.root.key(checkpoint_id, FLEET_MANIFEST_NAME))
        )
        if stored is None:
            raise NoPublishedCheckpoint(f"{self.directory(checkpoint_id)}: never published")
        return FleetManifest.decode(stored.data)

    def exists(self, name: str) -> bool:
        """Whether an object `name` lies directly below the root."""
        return self._call(lambda: self._client.exists(self.root.key(name)))

    def _call(self, operation: Callable[[], _T]) -> _T:
        try:
            return operation()
        except (ObjectStoreFailure, MissingExtra) as exc:
            raise _store_errors(exc) from None


def verify_object_checkpoint(url: str) -> tuple[CheckpointSummary, str | None]:
    """`inspect` of a URL: the checkpoint below it, or the one its `LATEST` names (then with a
    note saying so). `NoPublishedCheckpoint` when it holds neither."""
    location = parse_object_url(url)
    root = ObjectCheckpointRoot(location.url)
    if root.exists(FLEET_MANIFEST_NAME):
        return root.verify(location, expected_id=None), None
    latest = root.latest()
    if latest is None:
        raise NoPublishedCheckpoint(
            f"{location.url}: no {FLEET_MANIFEST_NAME} and no {LATEST_NAME}: nothing published here"
        )
    note = f"{location.url} is a checkpoint root: LATEST names {latest}"
    return root.inspect(latest), note


def _references_in(client: ObjectStoreClient, manifest_keys: Sequence[str]) -> set[str]:
    """The checkpoints the part manifests under `manifest_keys` reference (ObjectStoreFailure
    when one cannot be read; one larger than any manifest is nobody's and references nothing,
    as one that does not parse)."""
    references: set[str] = set()
    for key in manifest_keys:
        try:
            stored = client.get(key, limit=MANIFEST_LIMIT)
        except ValueError:
            continue
        if stored is not None:
            references |= manifest_references(stored.data)
    return references


def _is_part(relative: str) -> bool:
    """Whether a key below a checkpoint is a part's manifest
    (`participants/<kind>/<instance>/manifest.json`)."""
    components = relative.split("/")
    return (
        len(components) == 4
        and components[0] == PARTICIPANTS_DIR
        and components[3] == MANIFEST_NAME
        and all(is_valid_id(c) for c in components[1:3])
    )


def _latest_id(stored: StoredObject | None) -> str | None:
    if stored is None:
        return None
    text = stored.data.decode("utf-8", errors="replace")
    checkpoint_id = text[:-1] if text.endswith("\n") else text
    if not is_valid_id(checkpoint_id) or checkpoint_id == LATEST_NAME:
        return None
    return checkpoint_id


def _created_at_of(stored: StoredObject | None) -> datetime | None:
    """created_at read leniently (only that field), like `latest.created_at_for_ordering`."""
    if stored is None:
        return None
    try:
        fields = load_json(stored.data)
        if isinstance(fields, dict):
            return parse_time(fields.get("created_at"))
    except ValueError:
        pass
    return None


def _check_checkpoint_id(checkpoint_id: str) -> None:
    if not isinstance(checkpoint_id, str) or not is_valid_id(checkpoint_id):
        raise ValueError(f"not a valid checkpoint id: {checkpoint_id!r}")
    if checkpoint_id == LATEST_NAME:
        raise ValueError(f"{LATEST_NAME!r} is reserved and cannot be a checkpoint id")
